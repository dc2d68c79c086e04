"""Keyed hashes (engine/hashing.py): locks and downstream keys must stay the same across
versions and settings reloads, so they are checked against HMAC-SHA256 written out here;
and their secret is always the database's: IDEMPOTENCY_SECRET_KEY never replaces it, and a
server whose value differs is refused (SecretMismatch)."""

from __future__ import annotations

import hashlib
import hmac
import threading

import pytest
from django.db import DEFAULT_DB_ALIAS, connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_idempotency.engine.hashing import (
    SecretMismatch,
    claim_locks,
    current_secret,
    keyed_digest,
    lock_id,
)
from django_idempotency.storage import secret


def spec(secret: str, purpose: str, *parts: str) -> bytes:
    key = hashlib.sha256(f"django_idempotency:{purpose}:{secret}".encode()).digest()
    message = "\x00".join(f"{len(part)}:{part}" for part in parts).encode()
    return hmac.digest(key, message, "sha256")


def spec_lock(secret: str, principal: str, key: str) -> int:
    return int.from_bytes(spec(secret, "lock", principal, key)[:4], "big", signed=True)


def database_secret() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret FROM django_idempotency_secret WHERE id = 1")
        (value,) = cursor.fetchone()
    return str(value)


def test_keyed_digest_is_hmac_sha256_of_the_joined_parts_under_the_purposes_key() -> None:
    assert keyed_digest("first secret", "downstream", "v1", "user:1", "k", "capture") == spec(
        "first secret", "downstream", "v1", "user:1", "k", "capture"
    )
    # Repeated calls share the keyed HMAC and never each other's messages.
    assert keyed_digest("first secret", "lock", "a", "b") == spec("first secret", "lock", "a", "b")
    assert keyed_digest("first secret", "lock", "a", "b") == spec("first secret", "lock", "a", "b")
    assert keyed_digest("two", "lock", "a", "b") == spec("two", "lock", "a", "b")


@pytest.mark.django_db
def test_the_override_never_keys_the_lock_and_another_one_is_refused() -> None:
    made = database_secret()
    with override_settings(IDEMPOTENCY_SECRET_KEY="first secret"):
        # What the lock and the downstream keys are made with: the database's, always.
        assert lock_id(DEFAULT_DB_ALIAS, "a", "b") == spec_lock(made, "a", "b")
        assert current_secret(DEFAULT_DB_ALIAS) == made
        with pytest.raises(SecretMismatch, match="remove IDEMPOTENCY_SECRET_KEY"):
            claim_locks(DEFAULT_DB_ALIAS, "a", "b")
    with override_settings(IDEMPOTENCY_SECRET_KEY=made):
        assert claim_locks(DEFAULT_DB_ALIAS, "a", "b") == (spec_lock(made, "a", "b"), ())


@pytest.mark.django_db
def test_without_an_override_the_lock_is_keyed_with_the_databases_secret_not_secret_key() -> None:
    made = database_secret()
    assert len(made) == 64 and made.isalnum()
    expected = spec_lock(made, "a", "b")
    assert lock_id(DEFAULT_DB_ALIAS, "a", "b") == expected
    # Servers with other SECRET_KEYs (a rotation, a secret per pod) take the same lock.
    with override_settings(SECRET_KEY="another server's SECRET_KEY"):
        assert lock_id(DEFAULT_DB_ALIAS, "a", "b") == expected
        assert current_secret(DEFAULT_DB_ALIAS) == made


@pytest.mark.django_db
def test_the_databases_secret_is_read_once_per_process(secret_unread: None) -> None:
    with CaptureQueriesContext(connection) as first:
        current_secret(DEFAULT_DB_ALIAS)
    with CaptureQueriesContext(connection) as then:
        for _ in range(3):
            lock_id(DEFAULT_DB_ALIAS, "a", "b")
    # In a savepoint here (the test's transaction), so that a failed read breaks nothing.
    assert [q["sql"] for q in first if "SAVEPOINT" not in q["sql"]] == [secret._READ]
    assert len(then) == 0


@pytest.mark.django_db
def test_without_the_secrets_table_the_error_names_the_fix_and_never_falls_back(
    secret_unread: None,
) -> None:
    with connection.cursor() as cursor:
        # Rolled back with the test's transaction.
        cursor.execute("ALTER TABLE django_idempotency_secret RENAME TO moved_away")
    with pytest.raises(secret.SecretMissing, match=r"manage\.py migrate django_idempotency"):
        lock_id(DEFAULT_DB_ALIAS, "a", "b")
    # The failed read did not break the test's transaction.
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


@pytest.mark.django_db
def test_an_empty_secrets_table_is_an_error_too(secret_unread: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_idempotency_secret")  # rolled back
    with pytest.raises(secret.SecretMissing, match="no django_idempotency secret"):
        current_secret(DEFAULT_DB_ALIAS)


@pytest.mark.django_db
def test_without_fallbacks_a_claim_takes_one_lock() -> None:
    assert claim_locks(DEFAULT_DB_ALIAS, "a", "b") == (spec_lock(database_secret(), "a", "b"), ())


@pytest.mark.django_db
def test_with_fallbacks_a_claim_also_takes_the_locks_under_each_other_secret() -> None:
    made = database_secret()
    # The database's secret again among the fallbacks adds nothing: its lock is the claim's.
    with override_settings(IDEMPOTENCY_SECRET_KEY_FALLBACKS=["old", made]):
        assert claim_locks(DEFAULT_DB_ALIAS, "a", "b") == (
            spec_lock(made, "a", "b"),
            (spec_lock("old", "a", "b"),),
        )


@pytest.mark.django_db
@override_settings(IDEMPOTENCY_SECRET_KEY_FALLBACKS=["the secret before"])
def test_fallbacks_also_apply_to_the_databases_secret() -> None:
    lock, others = claim_locks(DEFAULT_DB_ALIAS, "a", "b")
    assert lock == spec_lock(database_secret(), "a", "b")
    assert others == (spec_lock("the secret before", "a", "b"),)


def test_threads_hashing_at_once_get_their_own_digests() -> None:
    found: dict[int, bytes] = {}

    def digest(n: int) -> None:
        for _ in range(200):
            found[n] = keyed_digest("shared", "lock", "principal", str(n))

    threads = [threading.Thread(target=digest, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert found == {n: spec("shared", "lock", "principal", str(n)) for n in range(8)}
