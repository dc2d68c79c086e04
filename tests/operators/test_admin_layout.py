"""The records' and the outbox's lists in headless Chromium at 1,280 and 1,440 px: every
column in sight (no horizontal scrolling of the results), a key on one line, long values cut
with an ellipsis. With ``IDEMPOTENCY_SCREENSHOTS=docs/_static`` the pages are saved there."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from django_idempotency.models import OutboxMessage
from tests.factories import ConsumerRecordFactory, IdempotencyRecordFactory
from tests.support.browser import PASSWORD, log_in, needs_chromium, screenshot

pytestmark = [needs_chromium, pytest.mark.django_db(transaction=True)]

LISTS = {
    "records": "/admin/django_idempotency/idempotencyrecord/",
    "outbox": "/admin/django_idempotency/outboxmessage/",
}
# The widest value of each kind the demo shows, and longer.
LONG_PATH = "/api/charges/4242/refunds/partial-with-a-rather-long-reason-slug/"


@pytest.fixture
def rows() -> None:
    now = timezone.now()
    for n in range(6):
        IdempotencyRecordFactory(
            scope=f"user:{n}", path=LONG_PATH, key=str(uuid.uuid4()), response_version="2026-11"
        )
    ConsumerRecordFactory(task="payments.post_ledger_entry_with_a_longer_name")
    for n in range(4):
        OutboxMessage.objects.create(
            id=uuid.uuid4(),
            created_at=now - timedelta(seconds=n),
            published_at=now,
            kind=OutboxMessage.Kind.TASK,
            name="payments.post_ledger_entry_with_a_longer_name",
            lease_owner="web-7f9c6d5b8-x2x7q:31337:9917a40b",
        )
    User.objects.create_superuser("admin", "admin@example.org", PASSWORD)


def layout(browser: Any) -> dict[str, Any]:
    # Measured once the page's fonts are in: a fallback font's widths differ.
    browser.execute_async_script("document.fonts.ready.then(arguments[arguments.length - 1])")
    return dict(
        browser.execute_script(
            """
            const results = document.querySelector('#changelist .results');
            const table = document.querySelector('#result_list');
            const keys = [...document.querySelectorAll('#result_list tbody th a')];
            const line = parseFloat(getComputedStyle(keys[0]).lineHeight) || 16;
            return {
              overflow: results.scrollWidth - results.clientWidth,
              pageOverflow: document.documentElement.scrollWidth - window.innerWidth,
              tableRight: table.getBoundingClientRect().right,
              filterLeft: document.querySelector('#changelist-filter').getBoundingClientRect().left,
              keyLines: Math.max(...keys.map(a => a.getBoundingClientRect().height / line)),
              rows: keys.length,
            };
            """
        )
    )


@pytest.mark.usefixtures("rows")
@pytest.mark.parametrize("width", [1280, 1440])
@pytest.mark.parametrize("page", sorted(LISTS))
def test_every_column_is_in_sight_and_a_key_keeps_one_line(
    browser: Any, live_server: Any, tmp_path: Path, page: str, width: int
) -> None:
    log_in(browser, live_server, "admin")
    browser.set_window_size(width, 900)
    browser.get(live_server.url + LISTS[page])

    seen = layout(browser)
    screenshot(browser, tmp_path, f"admin-{page}-{width}")

    assert seen["rows"] >= 4, seen
    assert seen["overflow"] <= 1, seen  # the results scroll sideways: a column is cut off
    assert seen["pageOverflow"] <= 1, seen
    assert seen["tableRight"] <= seen["filterLeft"], seen
    assert seen["keyLines"] < 1.6, seen  # one line, not a UUID over four
