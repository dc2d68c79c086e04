"""Erasure finishes what it starts (contract 8): a request of the principal that is running
when the erasure begins commits its record after the erasure's batches; the erasure waits
for it and erases that too, or says that it did not and exits non-zero."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
import requests
from django.contrib import admin
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import include, path, reverse

from django_idempotency.admin import records as records_admin
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import erasure
from tests.factories import IdempotencyRecordFactory, ScriptFactory, new_key
from tests.support.views import CALLS, GATES

# The scripted views and the admin, in one URLconf.
urlpatterns = [path("admin/", admin.site.urls), path("", include("tests.support.urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db(transaction=True)]

TENANT = "acme"
PRINCIPAL = f"tenant:{TENANT}"


def post(url: str, script: dict[str, Any], key: str) -> requests.Response:
    return requests.post(
        url,
        data=json.dumps(script),
        timeout=60,
        headers={"Content-Type": "application/json", "Idempotency-Key": key, "X-Tenant": TENANT},
    )


@pytest.fixture
def held(live_server: Any) -> Iterator[tuple[Future[requests.Response], dict[str, Any], str]]:
    """A request of the principal held inside its view (its key claimed, its record not
    yet written); the gate opens at the end of the test whatever happens."""
    script, key = ScriptFactory(gate=new_key()), new_key()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, live_server.url + "/drf/tenant/", script, key)
        assert GATES.wait_entered(script["gate"], 60), "the request never reached the view"
        try:
            yield first, script, key
        finally:
            GATES.open(script["gate"])


def test_erasing_while_a_request_runs_waits_for_it_and_erases_what_it_commits(
    held: Any, live_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, script, key = held
    wait_for = erasure._wait_for

    def released_after_the_batches(*args: Any) -> int:
        # The batches found nothing; only now does the request go on and commit its body.
        assert not IdempotencyRecord.objects.filter(key=key).exists()
        GATES.open(script["gate"])
        return wait_for(*args)

    monkeypatch.setattr(erasure, "_wait_for", released_after_the_batches)
    out = StringIO()
    call_command("idempotency_erase", "--principal", PRINCIPAL, stdout=out)

    assert first.result().status_code == 201
    assert out.getvalue() == f"{PRINCIPAL}: 1 records erased\n"
    record = IdempotencyRecord.objects.get(key=key)
    assert record.status == IdempotencyRecord.Status.ERASED and record.response_body is None
    retry = post(live_server.url + "/drf/tenant/", script, key)
    assert retry.status_code == 410 and CALLS[script["tag"]] == 1


def test_an_erasure_that_stops_waiting_says_so_exits_non_zero_and_a_rerun_finishes(
    held: Any,
) -> None:
    first, script, key = held
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match=r"incomplete.*Run it again"):
        call_command(
            "idempotency_erase", "--principal", PRINCIPAL, "--wait", "0.2", stdout=out, stderr=err
        )
    assert f"{PRINCIPAL}: 0 records erased, incomplete" in out.getvalue()
    assert "still running after 0.2s" in err.getvalue()

    GATES.open(script["gate"])
    assert first.result().status_code == 201
    again = StringIO()
    call_command("idempotency_erase", "--principal", PRINCIPAL, stdout=again)
    assert again.getvalue() == f"{PRINCIPAL}: 1 records erased\n"
    assert IdempotencyRecord.objects.get(key=key).status == IdempotencyRecord.Status.ERASED


def test_the_admin_action_says_when_a_request_in_flight_outlasted_its_wait(
    held: Any, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, script, _key = held
    monkeypatch.setattr(records_admin, "ADMIN_ERASE_WAIT", timedelta(seconds=0.2))
    earlier = IdempotencyRecordFactory(scope=PRINCIPAL)
    client.force_login(User.objects.create_superuser("root", "root@example.com", "x"))

    response = client.post(
        reverse("admin:django_idempotency_idempotencyrecord_changelist"),
        {"action": "erase_principals", "_selected_action": [earlier.pk]},
        follow=True,
    )

    text = response.content.decode()
    assert "requests in flight when the erasure began were still running" in text
    earlier.refresh_from_db()
    assert earlier.status == IdempotencyRecord.Status.ERASED
    GATES.open(script["gate"])
    assert first.result().status_code == 201
