"""The unit of work driven as a job runner or a CLI would: a ``Work`` and a ``Result``, no
HTTP request or response anywhere."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.db import connection, connections

from django_idempotency.engine.errors import InProgress, KeyReused
from django_idempotency.engine.unit import UnitOfWork
from django_idempotency.engine.work import Refuse, Replay, Result, Run, Work
from django_idempotency.models import IdempotencyRecord
from tests.factories import new_key
from tests.support.claims import advisory_lock_waiters

pytestmark = pytest.mark.django_db(transaction=True)

PRINCIPAL = "cli:importer"
HEADERS = [["content-type", "application/json"]]


class Importer:
    """The sender: what the engine's logs and signals name as running the work."""


def job(key: str, arguments: bytes = b'["batch-1"]') -> Work:
    return Work(
        principal=PRINCIPAL,
        key=key,
        method="JOB",
        path="importer.run",
        fingerprint={},  # keyed by the unit when it opens
        ttl=timedelta(hours=1),
        messages={"arguments": arguments},
    )


def unit_for(work: Work, wait: timedelta = timedelta(0)) -> UnitOfWork:
    return UnitOfWork(work, wait=wait, sender=Importer, kind="job")


def elsewhere(call: Callable[[], Any]) -> Any:
    """``call``'s answer on another thread, so on a connection of its own: what is visible
    there is committed."""

    def run() -> Any:
        try:
            return call()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result(timeout=60)


def written(tag: str) -> int:
    return Group.objects.filter(name__startswith=f"{tag}:").count()


def records(key: str) -> list[tuple[str, int]]:
    return list(IdempotencyRecord.objects.filter(key=key).values_list("method", "response_code"))


def run_once(key: str, body: bytes = b'{"imported":3}', status: int = 201) -> bool:
    """Run the work for ``key`` to the end: claim, write, store and commit."""
    unit = unit_for(job(key))
    assert isinstance(unit.open(), Run)
    Group.objects.create(name=f"{key}:{time.monotonic_ns()}")
    return unit.close(Result(status, HEADERS, body))


def test_a_won_claim_runs_the_work_and_commits_its_writes_with_the_stored_result() -> None:
    key = new_key()
    unit = unit_for(job(key))
    assert isinstance(unit.open(), Run)
    Group.objects.create(name=f"{key}:first")
    assert elsewhere(lambda: written(key)) == 0  # inside the claim's transaction until close
    assert unit.close(Result(201, HEADERS, b'{"imported":3}')) is True
    assert not connection.in_atomic_block
    assert elsewhere(lambda: written(key)) == 1
    assert elsewhere(lambda: records(key)) == [("JOB", 201)]


def test_the_same_work_again_is_replayed_with_its_stored_result_and_does_not_run() -> None:
    key = new_key()
    assert run_once(key, b'{"imported":3}')
    decision = unit_for(job(key)).open()
    assert isinstance(decision, Replay)
    assert (decision.status, decision.headers, decision.sent_body()) == (
        201,
        HEADERS,
        b'{"imported":3}',
    )
    assert not connection.in_atomic_block  # a replay holds no transaction
    assert written(key) == 1


def test_the_same_key_for_other_work_is_refused_as_reused_and_does_not_run() -> None:
    key = new_key()
    assert run_once(key)
    decision = unit_for(job(key, b'["batch-2"]')).open()
    assert isinstance(decision, Refuse)
    assert isinstance(decision.error, KeyReused)
    assert decision.error.extra["differing"] == ["arguments"]
    assert written(key) == 1


def test_a_failing_body_rolls_back_its_writes_and_the_key_stays_free() -> None:
    key = new_key()
    unit = unit_for(job(key))
    assert isinstance(unit.open(), Run)
    Group.objects.create(name=f"{key}:lost")
    unit.fail(ValueError("the import broke"))
    assert not connection.in_atomic_block
    assert written(key) == 0
    assert records(key) == []
    # The next attempt runs the work anew, and only its writes stay.
    assert run_once(key)
    assert written(key) == 1
    assert records(key) == [("JOB", 201)]


def test_a_result_that_is_not_kept_rolls_back_its_writes_and_the_key_stays_free() -> None:
    key = new_key()
    assert run_once(key, b'{"error":"down"}', status=503) is False
    assert written(key) == 0
    assert records(key) == []
    assert run_once(key)
    assert written(key) == 1


class Holder(threading.Thread):
    """Another worker's unit of the same work: it claims, then holds the key until told to
    finish (or, with ``until_waited``, until a claim waits on its lock), then commits."""

    def __init__(self, key: str, *, until_waited: bool = False) -> None:
        super().__init__(daemon=True)
        self.key, self.until_waited = key, until_waited
        self.won, self.finish = threading.Event(), threading.Event()
        self.stored: bool | None = None

    def run(self) -> None:
        try:
            unit = unit_for(job(self.key))
            decision = unit.open()
            self.won.set()
            if not isinstance(decision, Run):
                return
            Group.objects.create(name=f"{self.key}:holder")
            if self.until_waited:
                deadline = time.monotonic() + 30
                while advisory_lock_waiters() == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
            else:
                self.finish.wait(30)
            self.stored = unit.close(Result(201, HEADERS, b'{"imported":3}'))
        finally:
            self.won.set()
            connections.close_all()

    def done(self) -> bool | None:
        self.finish.set()
        self.join(60)
        assert not self.is_alive(), "the holder is stuck"
        return self.stored


def test_a_duplicate_in_flight_is_refused_in_progress_then_replayed_once_committed() -> None:
    key = new_key()
    holder = Holder(key)
    holder.start()
    assert holder.won.wait(30)
    try:
        decision = unit_for(job(key)).open()
    finally:
        stored = holder.done()
    assert isinstance(decision, Refuse)
    assert isinstance(decision.error, InProgress)
    assert decision.error.headers["Retry-After"]
    assert stored is True
    assert isinstance(unit_for(job(key)).open(), Replay)
    assert written(key) == 1


def test_a_duplicate_that_may_wait_waits_for_the_holder_and_gets_its_result() -> None:
    key = new_key()
    holder = Holder(key, until_waited=True)
    holder.start()
    assert holder.won.wait(30)
    # As a consumer waits: inside the database, on the key's lock.
    try:
        decision = unit_for(job(key), wait=timedelta(seconds=30)).open()
    finally:
        stored = holder.done()
    assert isinstance(decision, Replay)
    assert decision.sent_body() == b'{"imported":3}'
    assert stored is True
    assert written(key) == 1
