"""The claim on PostgreSQL (the plpgsql function), driven directly with an injected clock."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from psycopg.pq import Format, TransactionStatus

from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.storage import bodies, cursors
from django_idempotency.storage import records as storage
from django_idempotency.storage.erasure import erase
from django_idempotency.storage.records import Outcome
from tests.factories import ConsumerRecordFactory, IdempotencyRecordFactory, new_key
from tests.support.claims import (
    ClaimThread,
    body_of,
    claim,
    held_claim,
    store_body,
    store_first,
    wait_for_lock_waiters,
)

TTL = timedelta(hours=24)


def claim_and_complete(scope: str, key: str, now: datetime, ttl: timedelta = TTL) -> None:
    with transaction.atomic():
        claimed = claim(scope, key, now=now)
        assert claimed.outcome == Outcome.WON
        store_first(scope, key, claimed, ttl=ttl)


@pytest.mark.django_db
def test_winning_claim_writes_no_row_until_complete() -> None:
    key, now = new_key(), timezone.now()
    with transaction.atomic():
        claimed = claim("anonymous", key, now=now)
        assert claimed.outcome == Outcome.WON
        assert claimed.created_at == now
        assert not IdempotencyRecord.objects.filter(key=key).exists()
        store_first("anonymous", key, claimed, ttl=TTL)
    record = IdempotencyRecord.objects.get(key=key)
    assert record.created_at == now
    assert record.status == IdempotencyRecord.Status.COMPLETED


@pytest.mark.django_db
def test_claim_of_a_completed_key_finds_the_stored_response() -> None:
    key, now = new_key(), timezone.now()
    claim_and_complete("user:1", key, now)
    with transaction.atomic():
        found = claim("user:1", key, now=now + timedelta(minutes=5))
    assert found.outcome == Outcome.FOUND
    record = found.record
    assert record is not None
    assert (record.method, record.path, record.fingerprint) == ("POST", "/drf/", {"body": "x"})
    assert record.response_code == 201
    assert record.response_headers == [["Content-Type", "text/plain"]]
    assert record.body() == b"first"
    assert record.created_at == now


@pytest.mark.django_db
def test_record_lands_in_the_partition_of_its_utc_day() -> None:
    key, now = new_key(), timezone.now()
    claim_and_complete("anonymous", key, now)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tableoid::regclass::text FROM django_idempotency_record WHERE key = %s", [key]
        )
        (table,) = cursor.fetchone()
    assert table == RECORDS.partition_name(now.astimezone(UTC).date())


@pytest.mark.django_db
def test_after_its_ttl_a_key_can_be_claimed_again() -> None:
    key, now = new_key(), timezone.now()
    claim_and_complete("anonymous", key, now, ttl=timedelta(hours=1))
    with transaction.atomic():
        assert claim("anonymous", key, now=now + timedelta(minutes=59)).outcome == Outcome.FOUND
    with transaction.atomic():
        assert claim("anonymous", key, now=now + timedelta(minutes=61)).outcome == Outcome.WON


@pytest.mark.django_db
def test_expired_key_is_reported_during_the_gone_window_and_free_after_it() -> None:
    key, now = new_key(), timezone.now()
    claim_and_complete("anonymous", key, now, ttl=timedelta(hours=1))
    gone = timedelta(hours=1)
    with transaction.atomic():
        late = claim("anonymous", key, now=now + timedelta(minutes=90), gone=gone)
    assert late.outcome == Outcome.EXPIRED
    with transaction.atomic():
        later = claim("anonymous", key, now=now + timedelta(minutes=121), gone=gone)
    assert later.outcome == Outcome.WON


@pytest.mark.django_db
def test_the_newest_record_of_a_reused_key_is_the_one_found() -> None:
    key, now = new_key(), timezone.now()
    claim_and_complete("anonymous", key, now, ttl=timedelta(hours=1))
    with transaction.atomic():
        renewed = claim("anonymous", key, now=now + timedelta(hours=2))
        assert renewed.outcome == Outcome.WON
        store_first("anonymous", key, renewed, ttl=TTL)
    with transaction.atomic():
        found = claim("anonymous", key, now=now + timedelta(hours=2, minutes=1))
    assert found.record is not None
    assert found.record.created_at == now + timedelta(hours=2)


@pytest.mark.django_db
def test_keys_are_scoped_by_principal() -> None:
    key, now = new_key(), timezone.now()
    claim_and_complete("user:1", key, now)
    with transaction.atomic():
        assert claim("user:2", key, now=now).outcome == Outcome.WON


@pytest.mark.django_db
def test_key_held_by_another_connection_is_busy_without_waiting() -> None:
    key = new_key()
    with held_claim("anonymous", key), transaction.atomic():
        assert claim("anonymous", key).outcome == Outcome.BUSY


@pytest.mark.django_db
def test_key_held_for_one_principal_does_not_block_another() -> None:
    key = new_key()
    with held_claim("user:1", key), transaction.atomic():
        assert claim("user:2", key).outcome == Outcome.WON


def holder_and_waiter(key: str, *, complete: bool) -> tuple[ClaimThread, ClaimThread]:
    """A holder that has claimed ``key``, and a waiter queued on its lock."""
    holder = ClaimThread("anonymous", key, complete=complete)
    holder.start()
    holder.claimed.wait(30)
    waiter = ClaimThread("anonymous", key, wait=timedelta(seconds=30))
    waiter.start()
    wait_for_lock_waiters(1)
    return holder, waiter


@pytest.mark.django_db(transaction=True)
def test_waiter_gets_the_record_the_holder_commits() -> None:
    holder, waiter = holder_and_waiter(new_key(), complete=True)
    assert holder.result() == Outcome.WON
    assert waiter.result() == Outcome.FOUND


@pytest.mark.django_db(transaction=True)
def test_waiter_wins_when_the_holder_rolls_back() -> None:
    holder, waiter = holder_and_waiter(new_key(), complete=False)
    assert holder.result() == Outcome.WON
    assert waiter.result() == Outcome.WON


@pytest.mark.django_db(transaction=True)
def test_waiter_wins_when_the_holders_connection_dies_mid_request() -> None:
    # What a worker killed by kill -9 or the OOM killer leaves: a dead backend. Its claim
    # goes with it; there is no in-progress row to time out.
    key = new_key()
    holder, waiter = holder_and_waiter(key, complete=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [holder.pid])
    assert waiter.result() == Outcome.WON
    holder.result()
    assert holder.error is not None
    assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.django_db(transaction=True)
def test_waiter_gives_up_busy_when_its_wait_runs_out() -> None:
    key = new_key()
    with held_claim("anonymous", key):
        waiter = ClaimThread("anonymous", key, wait=timedelta(milliseconds=300))
        waiter.start()
        waiter.claimed.wait(30)
        assert waiter.result() == Outcome.BUSY


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_claim_refuses_to_run_where_its_snapshot_predates_the_lock(level: str) -> None:
    # A duplicate that waited for the lock would look the key up in a snapshot taken before
    # the holder committed: it must refuse rather than win blind.
    key = new_key()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
            cursor.execute("SELECT 1")  # the snapshot is taken here
        other = ClaimThread("anonymous", key, complete=True)
        other.start()
        assert other.result() is Outcome.WON  # stored and committed
        with pytest.raises(storage.IsolationRefused) as refused:
            claim("anonymous", key)
        transaction.set_rollback(True)
    assert (refused.value.using, refused.value.level) == ("default", level.lower())
    with transaction.atomic():
        assert claim("anonymous", key).outcome is Outcome.FOUND  # READ COMMITTED sees it


@pytest.mark.django_db(transaction=True)
def test_claim_refuses_a_level_set_as_the_sessions_default() -> None:
    # What ALTER DATABASE, ALTER ROLE and libpq's options set: the session's default.
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION default_transaction_isolation = 'repeatable read'")
    try:
        with pytest.raises(storage.IsolationRefused), transaction.atomic():
            claim("anonymous", new_key())
        # Nothing held: the refusal came before the lock, and the transaction is gone.
        assert connection.connection.info.transaction_status == TransactionStatus.IDLE
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_isolation")


@pytest.mark.django_db(transaction=True)
def test_claim_runs_at_read_uncommitted_which_postgresql_runs_as_read_committed() -> None:
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
        assert claim("anonymous", new_key()).outcome is Outcome.WON


# Bodies in binary both ways: the claim, the lookup and the store run on a cursor that binds
# on the server and reads binary results.


@pytest.mark.django_db(transaction=True)
def test_bodies_travel_in_binary_both_ways() -> None:
    cursors: list[tuple[str, Any]] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        cursors.append((sql.split("(", 1)[0], context["cursor"].cursor))
        return execute(sql, params, many, context)

    key, body = new_key(), body_of(256 * 1024)
    with connection.execute_wrapper(spy), CaptureQueriesContext(connection) as logged:
        with transaction.atomic():
            store_body("anonymous", key, body, commit=True)
        with transaction.atomic():
            found = claim("anonymous", key)
        looked_up = storage.lookup(DEFAULT_DB_ALIAS, principal="anonymous", key=key, window=TTL)
    assert found.record is not None and looked_up is not None
    assert found.record.body() == looked_up.body() == body
    # Django's query log (DEBUG) keeps the statement, not a 512 KB hex literal.
    [stored] = [q["sql"] for q in logged.captured_queries if "idempotency_store" in q["sql"]]
    assert stored.startswith("SELECT django_idempotency_store($1, $2,") and len(stored) < 200
    ours = [(sql, raw) for sql, raw in cursors if "idempotency" in sql or sql == "COMMIT"]
    assert [sql for sql, _ in ours] == [
        "SELECT * FROM django_idempotency_claim",
        "SELECT django_idempotency_store",
        "COMMIT",
        "SELECT * FROM django_idempotency_claim",
        "SELECT * FROM django_idempotency_lookup",
    ]
    # Server-side binding (not psycopg's ClientCursor, which writes a bytea as a hex
    # literal), and binary results (a bytea not read as hex text).
    assert all(type(raw) is psycopg.Cursor and raw.format == Format.BINARY for _, raw in ours)


LARGE = storage.BINARY_BODY_MIN_BYTES  # sent as a binary parameter; smaller as hex


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("size", [100, LARGE])
@pytest.mark.parametrize("commit", [False, True])
def test_the_store_commits_only_when_asked(size: int, commit: bool) -> None:
    key, body = new_key(), body_of(size)
    with transaction.atomic():
        store_body("anonymous", key, body, commit=commit)
        expected = TransactionStatus.IDLE if commit else TransactionStatus.INTRANS
        assert connection.connection.info.transaction_status == expected
    with transaction.atomic():
        found = claim("anonymous", key)
    assert found.record is not None and found.record.body() == body


@pytest.mark.django_db(transaction=True)
def test_without_pipelines_the_commit_is_left_to_django(monkeypatch) -> None:
    # libpq before 14 has no pipeline mode: the store travels alone, Django commits after.
    monkeypatch.setattr(psycopg.Pipeline, "is_supported", classmethod(lambda cls: False))
    key, body = new_key(), body_of(LARGE)
    with transaction.atomic():
        store_body("anonymous", key, body, commit=True)
        assert connection.connection.info.transaction_status == TransactionStatus.INTRANS
    with transaction.atomic():
        found = claim("anonymous", key)
    assert found.record is not None and found.record.body() == body


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("size", [100, LARGE])  # in one string with its COMMIT, or pipelined
def test_a_failed_store_is_a_django_error_and_commits_nothing(size: int) -> None:
    key = new_key()
    with pytest.raises(IntegrityError) as failed, transaction.atomic():
        claimed = claim("anonymous", key)
        assert claimed.created_at is not None
        storage.store(
            DEFAULT_DB_ALIAS,
            storage.Finished(
                principal="anonymous", key=key, method="POST", path="/drf/",
                fingerprint={}, created_at=claimed.created_at - timedelta(days=3650),
                expires_at=claimed.created_at, code=201, headers=[], body=body_of(size),
                body_encoding="",
            ),
            row_id=None,
            commit=True,
        )  # fmt: skip
    assert storage.missing_partition(failed.value)
    assert connection.connection.info.transaction_status == TransactionStatus.IDLE
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    # The connection's kept cursors serve the next claim and store.
    key = new_key()
    with transaction.atomic():
        store_body("anonymous", key, body_of(100), commit=True)
    with transaction.atomic():
        found = claim("anonymous", key)
    assert found.record is not None and found.record.body() == body_of(100)


@pytest.mark.django_db
@pytest.mark.parametrize("use_tz", [True, False])
def test_binary_timestamps_load_as_djangos_own(settings, use_tz: bool) -> None:
    settings.USE_TZ = use_tz
    sql = "SELECT '2026-03-01 12:30:00.123456+00'::timestamptz"
    with connection.cursor() as cursor:
        cursor.execute(sql)
        (django_loaded,) = cursor.fetchone()
    with cursors.binary_cursor(connection) as cursor:
        cursor.execute(sql)
        (binary_loaded,) = cursor.fetchone()
    # The kept cursor too, though it was made under the other setting in the other run.
    (kept_loaded,) = cursors.fetch_one(connection, sql, [])
    assert binary_loaded == kept_loaded == django_loaded
    assert binary_loaded.tzinfo == kept_loaded.tzinfo == django_loaded.tzinfo
    assert (binary_loaded.tzinfo is None) is not use_tz


# Who compresses a stored body: PostgreSQL (lz4) where the column has it, else the app.


def server_has_lz4() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'lz4' = ANY (enumvals) FROM pg_settings "
            "WHERE name = 'default_toast_compression'"
        )
        return bool(cursor.fetchone()[0])


@pytest.mark.django_db
def test_the_database_compresses_where_the_column_is_lz4_and_it_is_read_once(
    monkeypatch,
) -> None:
    monkeypatch.setattr(bodies, "_lz4_columns", {})
    with CaptureQueriesContext(connection) as first:
        compresses = bodies.database_compresses(DEFAULT_DB_ALIAS)
    with CaptureQueriesContext(connection) as again:
        assert bodies.database_compresses(DEFAULT_DB_ALIAS) is compresses
    assert (len(first), len(again)) == (1, 0)
    # The migration sets lz4 wherever the server has it.
    assert compresses is server_has_lz4()
    body = b'{"amount": 2499, "currency": "inr"}' * 100
    stored, encoding = bodies.encode_body(DEFAULT_DB_ALIAS, body, 2048)
    if compresses:
        assert (stored, encoding) == (body, "")
    else:
        assert encoding == bodies.compression(None) and len(stored) < len(body) // 10
    assert bodies.decode_body(stored, encoding) == body


@pytest.mark.django_db
def test_a_database_without_the_records_table_does_not_compress(monkeypatch) -> None:
    monkeypatch.setattr(bodies, "_lz4_columns", {})
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL search_path TO pg_catalog")  # the table out of sight
        assert bodies.database_compresses(DEFAULT_DB_ALIAS) is False


@pytest.mark.django_db
def test_the_app_stores_a_body_zlib_cannot_shrink_as_it_is(monkeypatch) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: False)
    body = os.urandom(4096)
    assert bodies.encode_body(DEFAULT_DB_ALIAS, body, 2048) == (body, "")


# The redrive's check and the admin's delete ------------------------------------------------


@pytest.mark.django_db
def test_recorded_finds_the_pairs_of_the_given_principals_and_keys_since_the_bound() -> None:
    since = timezone.now() - timedelta(hours=1)
    first, second, other = new_key(), new_key(), new_key()
    ConsumerRecordFactory(task="a", key=first)
    ConsumerRecordFactory(task="b", key=second)
    ConsumerRecordFactory(task="a", key=other)  # not a key asked for
    ConsumerRecordFactory(task="c", key=first)  # not a principal asked for
    ConsumerRecordFactory(task="a", key=second, created_at=since - timedelta(seconds=1))
    found = storage.recorded(
        DEFAULT_DB_ALIAS,
        principals={"consumer:a", "consumer:b"},
        keys=[first, second],
        since=since,
    )
    assert found == {("consumer:a", first), ("consumer:b", second)}


@pytest.mark.django_db
def test_recorded_counts_an_erased_consumer_record_under_its_principal() -> None:
    # Its tombstone answers a redelivery (410, acknowledged): no need to publish it again.
    key = new_key()
    ConsumerRecordFactory(task="a", key=key)
    erase(DEFAULT_DB_ALIAS, "consumer:a", batch=1000)
    since = timezone.now() - timedelta(hours=1)
    found = storage.recorded(DEFAULT_DB_ALIAS, principals={"consumer:a"}, keys=[key], since=since)
    assert found == {("consumer:a", key)}


@pytest.mark.django_db
def test_recorded_of_nothing_is_nothing() -> None:
    ConsumerRecordFactory(task="a")
    since = timezone.now() - timedelta(hours=1)
    assert storage.recorded(DEFAULT_DB_ALIAS, principals=set(), keys=[], since=since) == set()


@pytest.mark.django_db
def test_delete_frees_one_key_of_one_principal() -> None:
    record = IdempotencyRecordFactory(scope="user:1")
    kept = IdempotencyRecordFactory(scope="user:2", key=record.key)
    storage.delete(DEFAULT_DB_ALIAS, record_id=record.pk, created_at=record.created_at)
    assert list(IdempotencyRecord.objects.values_list("pk", flat=True)) == [kept.pk]
    assert claim("user:1", record.key).outcome is Outcome.WON
