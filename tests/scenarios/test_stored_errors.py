"""The bound on stored 4xx per principal and minute (IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE,
100 by default) holds across server processes: it is counted in the records' database. Per
process, 2 processes stored 158 of 200 invalid requests in 2 s."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord, StoredErrorCount
from tests.conftest import GunicornServer, TokenUser
from tests.factories import new_key
from tests.support.payments import post

pytestmark = pytest.mark.django_db

# Under the bound in each of two processes, over it in all: per process, every one is stored.
SENT = 150
# An invalid charge (amount below 1), padded towards the 60 KB answers of the report: the
# serializer echoes nothing, so the padding is in a field it ignores.
INVALID = {"amount": 0, "currency": "inr", "padding": "x" * 60_000}


@pytest.fixture(scope="module")
def two_processes(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
) -> Iterator[str]:
    with gunicorn_server(workers=2, threads=4) as server:
        yield server.url


def start_of_a_minute() -> None:
    """Wait out the end of a minute: the bound is per minute, and the requests must fall in
    one (a few seconds on a busy machine)."""
    left = 60 - time.time() % 60
    if left < 20:
        time.sleep(left + 0.5)


def test_the_bound_on_stored_4xx_holds_across_two_server_processes(
    two_processes: str, live_user: TokenUser
) -> None:
    keys = [new_key() for _ in range(SENT)]
    start_of_a_minute()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda key: post(two_processes, live_user, key, INVALID), keys))

    assert {answer.status_code for answer in answers} == {400}
    limit = conf.MAX_STORED_ERRORS_PER_MINUTE
    assert limit == 100
    stored = IdempotencyRecord.objects.filter(key__in=keys).count()
    assert stored == limit


def test_erasure_removes_the_principals_count_of_stored_4xx() -> None:
    from django_idempotency.engine import keeping
    from django_idempotency.storage.erasure import erase

    for _ in range(3):
        keeping.error_budget.take("default", "user:alice")
    keeping.error_budget.take("default", "user:bob")

    erase("default", "user:alice", batch=10)

    # Only these two principals: a live-server test of the module may leave counts of its own.
    counts = StoredErrorCount.objects.filter(scope__in=["user:alice", "user:bob"])
    assert list(counts.values_list("scope", "stored")) == [("user:bob", 1)]
