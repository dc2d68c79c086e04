"""Keyed digests (contract 4, 8; docs/data-you-keep.md): what the records table keeps of a
request (fingerprint parts, a principal stored as a digest, an erasure tombstone) is an HMAC
under a key of its purpose derived from the database's secret, never a plain SHA-256 that a
reader of the table could test guesses against; records from before still compare."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest

from django_idempotency.http import request as http_request
from django_idempotency.http.identity import fingerprint_messages, principal_for
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import digests
from testproject.payments.models import Charge
from tests.factories import new_key
from tests.support.client import problem, replayed

pytestmark = pytest.mark.django_db

CHARGE = {"amount": 2499, "currency": "inr", "card_last4": "4242"}


def charge(client: Any, key: str, body: dict[str, Any] = CHARGE) -> Any:
    return client.post("/api/charges/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_stored_fingerprint_parts_are_keyed_digests_that_no_guess_can_be_tested_against(
    token_user: Any,
) -> None:
    key = new_key()
    assert charge(token_user.client(), key).status_code == 201
    parts = IdempotencyRecord.objects.get(key=key).fingerprint

    assert parts and all(digests.is_keyed(value) for value in parts.values())
    # The method part was exactly sha256("POST"): now HMAC under the fingerprint's key.
    assert parts["method"] != sha256(b"POST") and sha256(b"POST") not in parts["method"]
    fingerprint_key = digests.purpose_key("default", "fingerprint")
    assert parts["method"] == "h1:" + hmac.new(fingerprint_key, b"POST", "sha256").hexdigest()
    # One key per purpose: the same message digested for a tombstone is another value.
    assert digests.digest_hex("default", "tombstone", b"POST") != parts["method"]


def test_the_same_request_gives_other_digests_under_another_databases_secret(
    monkeypatch: pytest.MonkeyPatch, rf: Any
) -> None:
    request = rf.post("/api/charges/", json.dumps(CHARGE), content_type="application/json")
    messages = fingerprint_messages(request)
    from django_idempotency.engine.fingerprints import keyed_parts

    here = keyed_parts("default", messages)
    monkeypatch.setattr(digests, "shared_secret", lambda using: "another project's secret")
    there = keyed_parts("default", messages)
    assert set(here) == set(there) and all(here[part] != there[part] for part in here)


def test_a_retry_of_a_record_stored_before_keyed_digests_replays_and_a_changed_one_is_422(
    token_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, bytes]] = []

    def capturing(*args: Any, **kwargs: Any) -> dict[str, bytes]:
        seen.append(fingerprint_messages(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(http_request, "fingerprint_messages", capturing)
    client, key = token_user.client(), new_key()
    first = charge(client, key)
    assert first.status_code == 201
    # The record as a release before keyed digests stored it: plain SHA-256 parts.
    plain = {name: sha256(message) for name, message in seen[0].items()}
    IdempotencyRecord.objects.filter(key=key).update(fingerprint=plain)
    charges = Charge.objects.count()

    retry = charge(client, key)
    changed = charge(client, key, {**CHARGE, "amount": 1})

    assert replayed(retry) and retry.content == first.content
    assert changed.status_code == 422 and problem(changed)["differing"] == ["body"]
    assert Charge.objects.count() == charges


def test_a_principal_too_long_to_store_is_a_keyed_digest() -> None:
    long = "tenant:" + "x" * 300

    stored = principal_for(None, lambda request: long)

    key_of = digests.purpose_key("default", "principal")
    expected = hmac.new(key_of, sha256(long.encode()).encode(), "sha256").hexdigest()
    assert stored == "sha256:h1:" + expected
    assert sha256(long.encode()) not in stored
