"""Erasure (contract 8): ``manage.py idempotency_erase`` and the records admin's action turn a
principal's records into tombstones, and a retry of an erased key gets 410, never a second
execution, until the record would have expired."""

from __future__ import annotations

import hashlib
import hmac
import logging
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.urls import reverse

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import digests
from django_idempotency.storage.erasure import tombstone_scope
from django_idempotency.storage.records import Outcome
from testproject.payments.models import Charge
from tests.factories import ConsumerRecordFactory, IdempotencyRecordFactory, new_key
from tests.support.claims import claim
from tests.support.client import problem, replayed

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:django_idempotency_idempotencyrecord_changelist")
CHARGE = {"amount": 2499, "currency": "inr"}


def charge(client: Any, key: str, body: dict[str, Any] = CHARGE) -> Any:
    return client.post("/api/charges/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def erase(*args: str) -> str:
    out = StringIO()
    call_command("idempotency_erase", *args, stdout=out)
    return out.getvalue()


def test_an_erased_key_gets_410_and_never_runs_again_while_others_keep_replaying(
    make_token_user: Any,
) -> None:
    alice, bob = make_token_user("alice"), make_token_user("bob")
    keys = [new_key(), new_key()]
    for key in keys:
        assert charge(alice.client(), key).status_code == 201
    bobs = new_key()
    bob_first = charge(bob.client(), bobs)
    charges = Charge.objects.count()

    out = erase("--user", "alice")
    assert f"user:{alice.user.pk}: 2 records erased" in out
    retry = charge(alice.client(), keys[0])
    changed = charge(alice.client(), keys[1], {**CHARGE, "amount": 1})

    assert retry.status_code == 410 and problem(retry)["type"].endswith("key-expired")
    assert changed.status_code == 410
    assert Charge.objects.count() == charges
    again = charge(bob.client(), bobs)
    assert replayed(again) and again.content == bob_first.content


def test_a_tombstone_keeps_digests_and_the_expiry_and_nothing_else(token_user: Any) -> None:
    key = new_key()
    charge(token_user.client(), key)
    stored = IdempotencyRecord.objects.get(key=key)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT fingerprint::text FROM django_idempotency_record WHERE key = %s", [key]
        )
        fingerprint_text = cursor.fetchone()[0]

    erase("--principal", stored.scope)

    tomb = IdempotencyRecord.objects.get(key=key)
    # Keyed (HMAC under the tombstone purpose's key), never the plain SHA-256 that a guess
    # of the principal (user:1, user:2...) could be tested against.
    plain = hashlib.sha256(stored.scope.encode()).hexdigest()
    key_of = digests.purpose_key("default", "tombstone")
    assert tomb.scope == "erased:h1:" + hmac.new(key_of, plain.encode(), "sha256").hexdigest()
    assert tomb.scope == tombstone_scope("default", stored.scope)
    assert tomb.status == IdempotencyRecord.Status.ERASED
    assert (tomb.method, tomb.path, tomb.body_encoding) == ("", "", "")
    assert tomb.response_body is None and tomb.response_headers is None
    assert tomb.response_code is None
    # The HMAC that SQL computes from the key's padded halves is the one Python computes.
    plain_fingerprint = hashlib.sha256(fingerprint_text.encode()).hexdigest().encode()
    expected = digests.digest_hex("default", "tombstone-fingerprint", plain_fingerprint)
    assert tomb.fingerprint == {"digest": expected}
    assert (tomb.created_at, tomb.expires_at) == (stored.created_at, stored.expires_at)


def test_erasing_again_erases_nothing_more_and_each_run_is_logged_and_signalled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    IdempotencyRecordFactory.create_batch(3, scope="tenant:acme")
    IdempotencyRecordFactory(scope="tenant:other")
    sent: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append(kwargs)

    signals.records_erased.connect(receiver)
    try:
        with caplog.at_level(logging.INFO, logger="django_idempotency"):
            first = erase("--principal", "tenant:acme", "--batch", "2")
            second = erase("--principal", "tenant:acme")
    finally:
        signals.records_erased.disconnect(receiver)

    assert first == "tenant:acme: 3 records erased\n"
    assert second == "tenant:acme: 0 records erased\n"
    assert [(s["principal"], s["count"]) for s in sent] == [("tenant:acme", 3), ("tenant:acme", 0)]
    lines = [r.getMessage() for r in caplog.records if "Erased" in r.getMessage()]
    assert len(lines) == 2 and tombstone_scope("default", "tenant:acme") in lines[0]
    assert "tenant:acme " not in lines[0]  # the log names the digest, not the principal
    assert IdempotencyRecord.objects.filter(scope="tenant:other").count() == 1


def test_a_tombstone_answers_until_the_record_would_have_expired_then_the_key_is_new() -> None:
    key = new_key()
    record = IdempotencyRecordFactory(scope="tenant:acme", key=key)
    erase("--principal", "tenant:acme")

    with transaction.atomic():
        assert claim("tenant:acme", key).outcome is Outcome.EXPIRED
    with transaction.atomic():
        later = record.expires_at + timedelta(seconds=1)
        assert claim("tenant:acme", key, now=later).outcome is Outcome.WON
    # Another principal's same key was never concerned.
    with transaction.atomic():
        assert claim("tenant:other", key).outcome is Outcome.WON


def test_the_user_option_takes_a_primary_key_and_refuses_an_unknown_user(
    token_user: Any,
) -> None:
    charge(token_user.client(), new_key())

    out = erase("--user", str(token_user.user.pk))

    assert f"user:{token_user.user.pk}: 1 records erased" in out
    with pytest.raises(CommandError, match="No user"):
        erase("--user", "nobody-at-all")


def test_an_erased_consumer_record_answers_its_redelivery_as_expired() -> None:
    record = ConsumerRecordFactory()
    erase("--principal", record.scope)

    with transaction.atomic():
        assert claim(record.scope, record.key).outcome is Outcome.EXPIRED


@pytest.fixture
def superuser_client(client: Any) -> Any:
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", "x"))
    return client


def test_the_admin_action_erases_the_selected_records_principals(
    superuser_client: Any, make_token_user: Any
) -> None:
    alice = make_token_user("alice")
    keys = [new_key(), new_key()]
    for key in keys:
        charge(alice.client(), key)
    other = IdempotencyRecordFactory(scope="tenant:other")
    selected = IdempotencyRecord.objects.get(key=keys[0])

    response = superuser_client.post(
        CHANGELIST,
        {"action": "erase_principals", "_selected_action": [selected.pk]},
        follow=True,
    )

    assert response.status_code == 200
    assert "Erased 2 records of 1 principal." in response.text
    assert charge(alice.client(), keys[1]).status_code == 410
    assert IdempotencyRecord.objects.get(pk=other.pk).scope == "tenant:other"


def test_the_admin_action_needs_the_delete_permission(client: Any) -> None:
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    client.force_login(viewer)
    record = IdempotencyRecordFactory(scope="tenant:acme")

    page = client.get(CHANGELIST)
    client.post(CHANGELIST, {"action": "erase_principals", "_selected_action": [record.pk]})

    assert "erase_principals" not in page.text
    assert IdempotencyRecord.objects.get(pk=record.pk).scope == "tenant:acme"
