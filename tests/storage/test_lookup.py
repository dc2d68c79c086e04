"""The lookup (a replay in one statement, the default before every claim) answers a record only
where the claim would answer ``found`` with it, and refuses where the claim refuses: anything
else it leaves to the claim."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, transaction
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import records as storage
from django_idempotency.storage.erasure import tombstone_scope
from tests.factories import new_key
from tests.support.claims import claim

TTL = timedelta(hours=1)
GONE = timedelta(hours=1)
WINDOW = timedelta(hours=24) + GONE
PRINCIPAL = "user:lookup"


def stored(key: str, *, version: str | None = None, ago: timedelta = timedelta(0)) -> datetime:
    """A record of ``key`` made ``ago`` (TTL one hour), of ``version``; its created_at."""
    with transaction.atomic():
        claimed = claim(PRINCIPAL, key, now=timezone.now() - ago, gone=GONE)
        assert claimed.created_at is not None
        storage.store(
            DEFAULT_DB_ALIAS,
            storage.Finished(
                principal=PRINCIPAL, key=key, method="POST", path="/drf/",
                fingerprint={"body": "x"}, created_at=claimed.created_at,
                expires_at=claimed.created_at + TTL, code=201, headers=[], body=b"first",
                body_encoding="", version=version, generation=claimed.generation,
            ),
            row_id=None,
            commit=False,
        )  # fmt: skip
    return claimed.created_at


def answers(key: str, *, version: str | None = None, now: datetime | None = None) -> tuple:
    """What the claim answers for ``key`` (rolled back), and whether the lookup found it."""
    with transaction.atomic():
        claimed = storage.claim(
            DEFAULT_DB_ALIAS, lock=1, principal=PRINCIPAL, key=key, window=WINDOW, gone=GONE,
            wait=timedelta(0), now=now, version=version,
        )  # fmt: skip
        transaction.set_rollback(True)
    found = storage.lookup(
        DEFAULT_DB_ALIAS, principal=PRINCIPAL, key=key, window=WINDOW, version=version, now=now
    )
    return claimed.outcome.value, found is not None


@pytest.mark.django_db(transaction=True)
def test_a_live_record_of_the_version_is_found_by_both() -> None:
    key = new_key()
    stored(key, version="v1")
    assert answers(key, version="v1") == ("found", True)


@pytest.mark.django_db(transaction=True)
def test_the_lookup_leaves_a_record_of_another_version_to_the_claim() -> None:
    key = new_key()
    stored(key, version="v1")
    assert answers(key, version="v2") == ("stale", False)


@pytest.mark.django_db(transaction=True)
def test_the_lookup_never_finds_an_expired_record_nor_one_expired_at_the_claims_now() -> None:
    expired = new_key()
    stored(expired, ago=TTL + timedelta(minutes=1))
    assert answers(expired) == ("expired", False)
    live = new_key()
    stored(live)
    # The claim's now (a test's, a consumer's): the lookup reads the records at that time.
    assert answers(live, now=timezone.now() + TTL + timedelta(minutes=1)) == ("expired", False)


@pytest.mark.django_db(transaction=True)
def test_the_lookup_never_replays_past_a_newer_tombstone_of_the_key() -> None:
    key = new_key()
    created = stored(key, ago=timedelta(minutes=10))
    # The key's newest row is a tombstone of the principal (an erased record of it).
    IdempotencyRecord.objects.create(
        scope=tombstone_scope(DEFAULT_DB_ALIAS, PRINCIPAL), key=key, method="POST", path="/drf/",
        fingerprint={}, created_at=created + timedelta(minutes=5),
        expires_at=created + timedelta(minutes=5) + TTL, status=IdempotencyRecord.Status.ERASED,
        generation=1,
    )  # fmt: skip
    assert answers(key) == ("expired", False)


@pytest.mark.django_db(transaction=True)
def test_the_lookup_never_answers_an_erased_record() -> None:
    key = new_key()
    stored(key)
    IdempotencyRecord.objects.filter(key=key).update(status=IdempotencyRecord.Status.ERASED)
    assert answers(key) == ("expired", False)


@pytest.mark.django_db(transaction=True)
def test_the_lookup_refuses_a_session_at_repeatable_read_as_the_claim_does() -> None:
    key = new_key()
    stored(key)
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION default_transaction_isolation = 'repeatable read'")
    try:
        with pytest.raises(storage.IsolationRefused) as refused:
            storage.lookup(DEFAULT_DB_ALIAS, principal=PRINCIPAL, key=key, window=WINDOW)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_isolation")
    assert refused.value.level == "repeatable read"


@contextlib.contextmanager
def serializable_in_options() -> Iterator[None]:
    """Django's connection made with OPTIONS {"isolation_level": SERIALIZABLE}: psycopg sets
    it on each BEGIN, so a statement outside a transaction runs at the session's level."""
    from psycopg import IsolationLevel

    connection.close()
    options = {**connection.settings_dict.get("OPTIONS", {})}
    options["isolation_level"] = IsolationLevel.SERIALIZABLE
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(connection.settings_dict, "OPTIONS", options)
            yield
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_the_lookup_refuses_an_isolation_level_that_the_claims_begin_would_set() -> None:
    key = new_key()
    stored(key)
    with serializable_in_options(), pytest.raises(storage.IsolationRefused) as refused:
        storage.lookup(DEFAULT_DB_ALIAS, principal=PRINCIPAL, key=key, window=WINDOW)
    assert refused.value.level == "serializable"
