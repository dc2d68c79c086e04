"""The claim on PostgreSQL (the plpgsql function), driven directly with an injected clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.storage.records import Outcome
from tests.claims import ClaimThread, claim, held_claim, store_first, wait_for_lock_waiters
from tests.factories import new_key

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
