"""The admin's stored responses in a real browser (headless Chromium through selenium), as a
user with and without ``view_stored_response``: what is on the page, and what is not.

With ``IDEMPOTENCY_SCREENSHOTS=<folder>`` the Response section is saved there as PNG files (the
ones in ``docs/_static/`` come from such a run)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from django_idempotency.storage import sealing
from tests.factories import IdempotencyRecordFactory
from tests.support.browser import PASSWORD, log_in, needs_chromium

CHARGE = {
    "id": 9,
    "amount": 2499,
    "currency": "eur",
    "card": {"number": "4242424242424242", "brand": "visa"},
    "payout": {"iban": "DE89370400440532013000", "accessToken": "tok_live_abc123"},
}
SECRETS = ("4242424242424242", "DE89370400440532013000", "tok_live_abc123", "/charges/9/")

pytestmark = [needs_chromium, pytest.mark.django_db(transaction=True)]


def open_record(
    browser: Any, live_server: Any, settings: Any, username: str, *codenames: str
) -> str:
    """The text of a sealed record's page, as ``username`` sees it."""
    from selenium.webdriver.common.by import By

    user = User.objects.create_user(username, password=PASSWORD, is_staff=True)
    for codename in ("view_idempotencyrecord", *codenames):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [base64.b64encode(os.urandom(32)).decode()]
    ring = sealing.keyring(tuple(settings.IDEMPOTENCY_ENCRYPTION_KEYS))
    assert ring is not None
    scope, key = f"user:{user.pk}", "charge-2026-11-27-0042"
    body, encoding = sealing.seal(
        ring,
        scope=scope,
        key=key,
        status=201,
        headers=[["Content-Type", "application/json"], ["Location", "/charges/9/"]],
        body=json.dumps(CHARGE).encode(),
        encoding="",
    )
    record = IdempotencyRecordFactory(
        key=key,
        scope=scope,
        path="/api/charges/",
        response_code=201,
        response_headers=None,
        response_body=body,
        body_encoding=encoding,
    )
    log_in(browser, live_server, username)
    url = reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk])
    browser.get(live_server.url + url)
    response = browser.find_element(By.XPATH, "//fieldset[.//h2[contains(., 'Response')]]")
    folder = os.environ.get("IDEMPOTENCY_SCREENSHOTS")
    if folder:
        response.screenshot(str(Path(folder) / f"admin-stored-response-{username}.png"))
    text: str = browser.find_element(By.TAG_NAME, "body").text
    return text


def test_in_a_browser_a_user_with_the_permission_reads_the_stored_response(
    browser, live_server, settings
) -> None:
    page = open_record(browser, live_server, settings, "reader", "view_stored_response")
    for secret in SECRETS:
        assert secret in page
    assert "[redacted]" not in page
    assert "RESPONSE BODY" in page.upper()
    assert "BODY DIGEST" in page.upper() and "h1:" in page
    assert "sealed with AES-256-GCM under key" in page


def test_in_a_browser_a_user_without_it_sees_sizes_and_masked_headers_but_no_body(
    browser, live_server, settings
) -> None:
    page = open_record(browser, live_server, settings, "viewer")
    for secret in (*SECRETS, "2499", "eur", "visa"):
        assert secret not in page
    for shown in ("bytes as sent", "Hidden:", "Content-Type: application/json"):
        assert shown in page
    # Neither a body digest (a test for a guess of the masked card) nor its label.
    assert "sha256:" not in page and "h1:" not in page and "BODY DIGEST" not in page.upper()
    assert "Location: [redacted]" in page


def test_in_a_browser_fields_listed_to_show_appear_with_the_redaction_list_masked(
    browser, live_server, settings
) -> None:
    settings.IDEMPOTENCY_ADMIN_SHOW_FIELDS = ["amount", "currency", "card"]
    page = open_record(browser, live_server, settings, "viewer")
    for secret in SECRETS:
        assert secret not in page
    for shown in ("2499", "eur"):
        assert shown in page
    assert "payout" not in page and "visa" not in page
    assert page.count("[redacted]") == 2  # card, Location
