"""Who reads a stored response in the admin (contract 8a): the body and headers with the
``view_stored_response`` permission; without it, the status, sizes and masked headers, no
body and no digest of it, unless fields to show are listed (with the redaction list masked)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os

import pytest
from django.contrib.auth.models import Permission, User
from django.test import override_settings
from django.urls import reverse

from django_idempotency.admin.responses import MASK, Shown, masked
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import digests
from tests.factories import IdempotencyRecordFactory, ScriptFactory, new_key
from tests.support.client import send

pytestmark = pytest.mark.django_db

CHARGE = {
    "id": 9,
    "amount": 2499,
    "company": "Acme Payments",
    "card": {"number": "4242424242424242", "brand": "visa"},
    "payout": {"iban": "DE89370400440532013000", "accessToken": "tok_live_abc123"},
    "items": [{"cardNumber": "5555555555554444", "sku": "plan-gold"}],
}
SECRETS = ("4242424242424242", "DE89370400440532013000", "tok_live_abc123", "5555555555554444")
SHOWN = ("2499", "Acme Payments", "plan-gold")


def detail_url(record: IdempotencyRecord) -> str:
    return reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk])


def staff(client, *codenames: str):
    user = User.objects.create_user(f"staff-{new_key()[:8]}", is_staff=True)
    for codename in ("view_idempotencyrecord", *codenames):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(user)
    return client


@pytest.fixture
def reader(client):
    return staff(client, "view_stored_response")


@pytest.fixture
def viewer(client):
    return staff(client)


def charge_record(**fields) -> IdempotencyRecord:
    return IdempotencyRecordFactory(
        response_headers=[["Content-Type", "application/json"], ["Location", "/charges/9/"]],
        response_body=json.dumps(CHARGE).encode(),
        **fields,
    )


def test_the_permission_exists_and_superusers_have_it() -> None:
    assert Permission.objects.filter(codename="view_stored_response").exists()
    admin = User.objects.create_superuser("root", "root@example.com", "x")
    assert admin.has_perm("django_idempotency.view_stored_response")


@pytest.mark.parametrize("who", ["reader", "superuser"])
def test_a_user_with_the_permission_reads_the_stored_body_and_headers(client, who) -> None:
    if who == "superuser":
        client.force_login(User.objects.create_superuser("root", "root@example.com", "x"))
    else:
        staff(client, "view_stored_response")
    record = charge_record()
    page = client.get(detail_url(record)).text
    for secret in SECRETS:
        assert secret in page
    assert "Location: /charges/9/" in page
    assert MASK not in page


def test_a_user_without_the_permission_sees_status_size_and_masked_headers_but_no_body(
    viewer,
) -> None:
    record = charge_record()
    body = bytes(record.response_body)
    page = viewer.get(detail_url(record)).text
    for secret in (*SECRETS, *SHOWN, "visa"):
        assert secret not in page
    assert "201" in page
    assert f"{len(body)} bytes as sent, {len(body)} bytes stored" in page
    assert f"Hidden: {len(body)} bytes, shown only with the permission" in page
    # Nothing from which the body could be recovered: no digest of it, plain or keyed.
    assert hashlib.sha256(body).hexdigest()[:16] not in page
    assert "body digest" not in page and "sha256:" not in page
    assert Shown([], body, len(body)).digest("default") not in page
    assert "Content-Type: application/json" in page
    assert f"Location: {MASK}" in page
    assert "/charges/9/" not in page


def test_a_reader_sees_a_keyed_digest_of_the_body(reader) -> None:
    record = charge_record()
    body = bytes(record.response_body)
    page = reader.get(detail_url(record)).text
    key = digests.purpose_key("default", "admin-body")
    assert "h1:" + hmac.new(key, body, "sha256").hexdigest()[:16] in page
    assert hashlib.sha256(body).hexdigest()[:16] not in page


def test_fields_to_show_without_the_permission_are_opt_in_and_redaction_still_masks(
    viewer, settings
) -> None:
    settings.IDEMPOTENCY_ADMIN_SHOW_FIELDS = ["amount", "company", "items.sku", "card"]
    page = viewer.get(detail_url(charge_record())).text
    for kept in SHOWN:
        assert kept in page
    for secret in (*SECRETS, "visa", "payout"):
        assert secret not in page
    assert page.count(MASK) == 2  # card (on the redaction list), Location


def test_the_default_redaction_list_masks_api_keys_pins_auth_codes_and_cardholders(
    viewer, settings
) -> None:
    fields = {"api_key": "sk_1", "pin": "0000", "auth_code": "A1B2C3", "cardholder_name": "Ann"}
    settings.IDEMPOTENCY_ADMIN_SHOW_FIELDS = [*fields, "id"]
    record = IdempotencyRecordFactory(
        response_headers=[["Content-Type", "application/json"]],
        response_body=json.dumps({"id": 9, **fields}).encode(),
    )
    page = viewer.get(detail_url(record)).text
    assert page.count(MASK) == 4
    for value in fields.values():
        assert value not in page


def test_without_the_permission_a_body_that_is_not_json_is_not_shown(viewer, settings) -> None:
    settings.IDEMPOTENCY_ADMIN_SHOW_FIELDS = ["token"]
    record = IdempotencyRecordFactory(
        response_headers=[["Content-Type", "text/plain"]], response_body=b"token=tok_live_abc123"
    )
    page = viewer.get(detail_url(record)).text
    assert "tok_live_abc123" not in page
    assert "Hidden: 21 bytes" in page


def test_the_redaction_list_is_a_setting(viewer, settings) -> None:
    settings.IDEMPOTENCY_ADMIN_SHOW_FIELDS = ["amount", "card"]
    settings.IDEMPOTENCY_ADMIN_REDACT_FIELDS = ["amount"]
    page = viewer.get(detail_url(charge_record())).text
    assert "2499" not in page
    assert "4242424242424242" in page


def test_a_sealed_response_is_opened_for_readers_and_masked_for_others(client, settings) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [base64.b64encode(os.urandom(32)).decode()]
    settings.IDEMPOTENCY_ADMIN_REDACT_FIELDS = ["nonce"]
    key = new_key()
    script = ScriptFactory(headers={"Location": "/charges/9/"})
    with override_settings(ROOT_URLCONF="tests.support.urls"):
        nonce = send(client, "POST", "/drf/", script, key=key).json()["nonce"]
    record = IdempotencyRecord.objects.get(key=key)
    assert nonce.encode() not in bytes(record.response_body)
    shown = staff(client, "view_stored_response").get(detail_url(record)).text
    assert "sealed with AES-256-GCM under key" in shown
    assert nonce in shown
    assert "Location: /charges/9/" in shown
    client.logout()
    settings.IDEMPOTENCY_ADMIN_SHOW_FIELDS = ["tag", "nonce"]
    masked_page = staff(client).get(detail_url(record)).text
    assert "sealed with AES-256-GCM under key" in masked_page
    assert nonce not in masked_page
    assert script["tag"] in masked_page
    # A record that no listed key opens says so, for either user.
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [base64.b64encode(os.urandom(32)).decode()]
    assert "is not among IDEMPOTENCY_ENCRYPTION_KEYS" in client.get(detail_url(record)).text


@pytest.mark.parametrize(
    ("key", "hidden"),
    [
        ("card", True),
        ("card_number", True),
        ("cardNumber", True),
        ("CARD-HOLDER", True),
        ("access_token", True),
        ("bank_account_number", True),
        ("account", False),
        ("company", False),
        ("expand", False),
        ("discarded", False),
    ],
)
def test_keys_are_masked_by_whole_words_in_any_case(key: str, hidden: bool) -> None:
    names = ("card", "token", "pan", "account_number")
    assert (masked({key: "x"}, names)[key] == MASK) is hidden
