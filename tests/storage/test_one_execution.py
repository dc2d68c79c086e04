"""The database refuses a second execution of a key: within a partition, a
unique index on (key, scope, generation) makes the second commit of one (principal, key)
fail when the advisory lock did not serialise them, and the loser is rolled back and answered
as a duplicate. Across a partition boundary only the lock guards. A key that expired (or ran
anew) starts the next generation, so the index never refuses it."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest
import requests
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction

from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.storage import records as storage
from tests.factories import ScriptFactory, new_key
from tests.support.claims import store_first
from tests.support.client import replayed
from tests.support.partitions import execute, today
from tests.support.views import CALLS, GATES, business_rows

pytestmark = [pytest.mark.urls("tests.support.urls"), pytest.mark.django_db(transaction=True)]

SCOPE = "tests:one-execution"
TTL = timedelta(hours=1)
# Lock ids that no claim shares with another: the lock that should serialise a key does not
# (a split secret, a bug, a refactor).
_UNSHARED = itertools.count(1)


def unshared_lock() -> int:
    return next(_UNSHARED)


@pytest.fixture
def lock_that_does_not_serialise() -> Iterator[None]:
    """Every claim takes a lock of its own: only the database can stop a second execution."""
    with mock.patch(
        "django_idempotency.engine.unit.claim_locks",
        side_effect=lambda using, principal, key: (unshared_lock(), ()),
    ):
        yield


def claim(key: str, *, now: datetime | None = None, window: timedelta = TTL) -> storage.Claimed:
    return storage.claim(
        DEFAULT_DB_ALIAS, lock=unshared_lock(), principal=SCOPE, key=key, window=window,
        gone=timedelta(0), wait=timedelta(0), now=now,
    )  # fmt: skip


def post(url: str, script: dict[str, Any], key: str) -> requests.Response:
    return requests.post(
        url, data=json.dumps(script), timeout=90,
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )  # fmt: skip


def test_a_second_execution_that_the_lock_let_through_is_rolled_back_and_answered_409(
    live_server: Any, lock_that_does_not_serialise: None
) -> None:
    url, key = live_server.url + "/drf/", new_key()
    script = ScriptFactory(gate=new_key())
    with ThreadPoolExecutor(1) as pool:
        # The first execution holds the key inside the view...
        first = pool.submit(post, url, script, key)
        assert GATES.wait_entered(script["gate"], 60)
        # ...and its duplicate, under a lock of its own, runs and commits meanwhile.
        second = post(url, script, key)
        GATES.open(script["gate"])
        refused = first.result()
    assert second.status_code == 201, second.text
    # The first one to store lost: rolled back, answered as a duplicate still in flight.
    assert refused.status_code == 409, refused.text
    assert refused.json()["type"].endswith("in-progress")
    assert int(refused.headers["Retry-After"]) >= 1
    assert CALLS[script["tag"]] == 2  # both ran...
    assert business_rows(script["tag"]) == 1  # ...one committed
    assert IdempotencyRecord.objects.filter(key=key).count() == 1
    # The retry gets the execution that committed.
    retry = post(url, script, key)
    assert retry.status_code == 201 and replayed(retry)
    assert retry.content == second.content


def race(key: str, first_at: datetime | None, second_at: datetime | None) -> BaseException | None:
    """Two executions of ``key`` whose locks do not serialise them: each claims before the
    other commits; the first stores and commits, then the second stores. What the second's
    store raised (None: it committed)."""
    claimed_second, first_stored = threading.Event(), threading.Event()
    raised: list[BaseException] = []

    def second() -> None:
        try:
            with transaction.atomic():
                claimed = claim(key, now=second_at)
                # It never saw the first, which has not committed.
                assert claimed.outcome is storage.Outcome.WON and claimed.generation == 0
                claimed_second.set()
                assert first_stored.wait(30)
                store_first(SCOPE, key, claimed, ttl=TTL)
        except BaseException as exc:
            raised.append(exc)
        finally:
            claimed_second.set()
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        with transaction.atomic():
            claimed = claim(key, now=first_at)
            assert claimed.outcome is storage.Outcome.WON and claimed.generation == 0
            done = pool.submit(second)
            assert claimed_second.wait(30)
            store_first(SCOPE, key, claimed, ttl=TTL)
        first_stored.set()
        done.result(30)
    return raised[0] if raised else None


def test_the_database_refuses_the_second_commit_and_says_which_index() -> None:
    key = new_key()
    error = race(key, None, None)
    assert isinstance(error, IntegrityError) and storage.second_execution(error), error
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


def test_across_a_partition_boundary_only_the_lock_guards() -> None:
    # The documented limit: the index is per partition (UTC day), so two executions claimed
    # on either side of midnight, under locks that do not serialise, both commit.
    key = new_key()
    midnight = datetime.combine(today() + timedelta(days=1), datetime.min.time(), UTC)
    error = race(key, midnight - timedelta(milliseconds=1), midnight + timedelta(milliseconds=1))
    assert error is None
    assert IdempotencyRecord.objects.filter(key=key).count() == 2


def test_a_key_that_expired_starts_the_next_generation_and_is_not_refused() -> None:
    # Both in today's partition, the window shorter than the time between them: the claim
    # still reads the first record (from the start of the partition) to number the next.
    key, start = new_key(), datetime.combine(today(), datetime.min.time(), UTC)
    with transaction.atomic():
        first = claim(key, now=start + timedelta(hours=1))
        store_first(SCOPE, key, first, ttl=timedelta(seconds=1))
    with transaction.atomic():
        again = claim(key, now=start + timedelta(hours=3), window=timedelta(minutes=1))
        assert again.outcome is storage.Outcome.WON and again.generation == 1
        store_first(SCOPE, key, again, ttl=timedelta(seconds=1))
    generations = IdempotencyRecord.objects.filter(key=key).order_by("created_at")
    assert list(generations.values_list("generation", flat=True)) == [0, 1]


def test_every_partition_of_the_records_table_has_the_index() -> None:
    names = execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = %s::regclass",
        [RECORDS.table],
    )
    indexed = execute(
        "SELECT tablename FROM pg_indexes WHERE indexname = tablename || '_one_execution' "
        "AND indexdef LIKE 'CREATE UNIQUE INDEX %%(key, scope, generation)'"
    )
    assert names and {name for (name,) in names} <= {name for (name,) in indexed}
