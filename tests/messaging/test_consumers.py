"""Exactly-once consumers in process: ``task.apply(task_id=...)`` runs a task through Celery's
own tracer, as a worker does, so each call is one delivery of that message id.

The proofs with a broker, worker processes that get killed and a relay are in test_chain.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

pytest.importorskip("celery")
from celery import shared_task
from celery.exceptions import Reject, Retry
from django.core import checks
from django.db import DEFAULT_DB_ALIAS, OperationalError, connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency.engine.errors import KeyReused, RolledBack
from django_idempotency.messaging.consumers import celery as consumers
from django_idempotency.messaging.consumers.celery import ExactlyOnceTask
from django_idempotency.messaging.consumers.exactly_once import arguments_digest
from django_idempotency.messaging.downstream import derive_key
from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from django_idempotency.storage import digests
from django_idempotency.storage import records as storage
from django_idempotency.storage.erasure import erase

pytestmark = pytest.mark.django_db(transaction=True)

# What the bodies did, in order: (task, message id, argument).
RAN: list[tuple[str, str | None, Any]] = []
GATE = threading.Event()


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    RAN.clear()
    GATE.set()
    yield
    GATE.set()


@shared_task(base=ExactlyOnceTask, bind=True, name="tests.consumers.note")
def note(self: ExactlyOnceTask, value: Any, *, fail: bool = False, retry: bool = False) -> Any:
    RAN.append(("note", self.request.id, value))
    # A write in the task's transaction: it must stay only if the delivery commits.
    enqueue_task("tests.consumers.next", (value,))
    if not GATE.wait(timeout=10):
        raise AssertionError("the gate stayed closed")
    if fail:
        raise ValueError("the body failed")
    if retry:
        raise Retry("try again later")
    return {"value": value, "key": derive_key("downstream")}


def deliver(task: Any, message_id: str, *args: Any, **kwargs: Any) -> Any:
    """One delivery of ``message_id``: the EagerResult Celery's tracer gives."""
    return task.apply(args, kwargs, task_id=message_id)


def test_the_first_delivery_runs_the_body_and_commits_its_result_with_its_writes() -> None:
    message_id = str(uuid.uuid4())
    result = deliver(note, message_id, 7)
    assert result.state == "SUCCESS"
    assert result.result["value"] == 7
    assert [("note", message_id, 7)] == RAN
    assert OutboxMessage.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.scope, record.key, record.method, record.path) == (
        "consumer:tests.consumers.note",
        message_id,
        "TASK",
        "tests.consumers.note",
    )
    # Keyed (HMAC under the fingerprint's key), never the plain digest of the arguments.
    fingerprint_key = digests.purpose_key("default", "fingerprint")
    keyed = hmac.new(fingerprint_key, b"[[7],{}]", "sha256").hexdigest()
    assert record.fingerprint == {"arguments": "h1:" + keyed}
    lifetime = record.expires_at - record.created_at
    assert lifetime == timedelta(days=7)


def test_the_arguments_digest_is_the_sha256_of_their_canonical_json() -> None:
    # Stored fingerprints outlive deployments: a redelivery after an upgrade must match a
    # record stored before keyed digests, whose part is this plain digest.
    canonical = '[[1,"x",[2,3]],{"a":"2.50","b":null,"when":"2026-01-02T03:04:05Z"}]'
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    digest = arguments_digest((1, "x", [2, 3]), {"when": when, "b": None, "a": Decimal("2.50")})
    assert digest == hashlib.sha256(canonical.encode()).hexdigest()


def test_a_redelivery_returns_the_stored_result_without_running_the_body() -> None:
    message_id = str(uuid.uuid4())
    first = deliver(note, message_id, 7).result
    again = deliver(note, message_id, 7)
    assert again.state == "SUCCESS" and again.result == first
    assert len(RAN) == 1 and OutboxMessage.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1


def test_another_message_id_runs_again() -> None:
    deliver(note, str(uuid.uuid4()), 7)
    deliver(note, str(uuid.uuid4()), 7)
    assert len(RAN) == 2 and OutboxMessage.objects.count() == 2


@pytest.mark.parametrize(
    ("switch", "state"), [("fail", "FAILURE"), ("retry", "RETRY")], ids=["raise", "retry"]
)
def test_a_delivery_that_raises_or_retries_leaves_nothing_and_the_next_one_runs(
    switch: str, state: str
) -> None:
    message_id = str(uuid.uuid4())
    assert deliver(note, message_id, 7, **{switch: True}).state == state
    assert not IdempotencyRecord.objects.exists() and not OutboxMessage.objects.exists()
    assert deliver(note, message_id, 7).state == "SUCCESS"
    assert len(RAN) == 2 and OutboxMessage.objects.count() == 1


def test_the_same_message_id_with_other_arguments_is_refused_and_not_run() -> None:
    message_id = str(uuid.uuid4())
    deliver(note, message_id, 7)
    refused = deliver(note, message_id, 8)
    assert refused.state == "FAILURE" and isinstance(refused.result, KeyReused)
    assert len(RAN) == 1


def test_a_direct_call_runs_the_body_as_a_plain_function_and_records_nothing() -> None:
    # derive_key() has no unit to derive from: the body fails the way it should.
    with transaction.atomic(), pytest.raises(RuntimeError, match="derive_key"):
        note(7)
    assert RAN == [("note", None, 7)]
    assert not IdempotencyRecord.objects.exists()


def test_a_concurrent_delivery_waits_for_the_holder_then_replays() -> None:
    message_id = str(uuid.uuid4())
    GATE.clear()
    results: dict[str, Any] = {}
    first = threading.Thread(target=lambda: results.update(first=deliver(note, message_id, 7)))
    first.start()
    while not RAN:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: results.update(second=deliver(note, message_id, 7)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive()  # waiting on the claim, not running the body
    GATE.set()
    first.join(10)
    second.join(10)
    assert results["first"].state == results["second"].state == "SUCCESS"
    assert results["second"].result == results["first"].result
    assert len(RAN) == 1 and OutboxMessage.objects.count() == 1


@override_settings(IDEMPOTENCY_CONSUMER_WAIT=timedelta(milliseconds=200))
def test_a_concurrent_delivery_that_waits_too_long_goes_back_to_the_broker() -> None:
    message_id = str(uuid.uuid4())
    GATE.clear()
    holder = threading.Thread(target=deliver, args=(note, message_id, 7))
    holder.start()
    while not RAN:
        time.sleep(0.01)
    busy = deliver(note, message_id, 7)
    assert busy.state == "REJECTED"
    assert isinstance(busy.result, Reject) and busy.result.requeue
    GATE.set()
    holder.join(10)
    assert len(RAN) == 1 and IdempotencyRecord.objects.count() == 1


@override_settings(IDEMPOTENCY_MAX_TTL=timedelta(minutes=1))
def test_a_consumer_record_older_than_max_ttl_is_still_found_within_the_consumer_ttl() -> None:
    message_id = str(uuid.uuid4())
    created = timezone.now() - timedelta(minutes=30)
    storage.store(
        "default",
        storage.Finished(
            principal="consumer:tests.consumers.note",
            key=message_id,
            method="TASK",
            path="tests.consumers.note",
            fingerprint={"arguments": arguments_digest((7,), {})},
            created_at=created,
            expires_at=created + timedelta(days=7),
            code=200,
            headers=[],
            body=b'{"value": 7, "key": "stored"}',
            body_encoding="",
        ),
        row_id=None,
        commit=False,
    )
    assert deliver(note, message_id, 7).result == {"value": 7, "key": "stored"}
    assert RAN == []


def test_the_consumer_name_scopes_message_ids() -> None:
    @shared_task(base=ExactlyOnceTask, bind=True, name="tests.consumers.other")
    def other(self: ExactlyOnceTask, value: Any) -> Any:
        RAN.append(("other", self.request.id, value))
        return value

    message_id = str(uuid.uuid4())
    deliver(note, message_id, 7)
    deliver(other, message_id, 7)
    assert [name for name, _, _ in RAN] == ["note", "other"]
    assert set(IdempotencyRecord.objects.values_list("scope", flat=True)) == {
        "consumer:tests.consumers.note",
        "consumer:tests.consumers.other",
    }


def test_downstream_keys_derive_from_the_message_id() -> None:
    one, two = str(uuid.uuid4()), str(uuid.uuid4())
    first = deliver(note, one, 7, fail=True)
    assert first.state == "FAILURE"
    again = deliver(note, one, 7).result["key"]
    other = deliver(note, two, 7).result["key"]
    assert again != other
    assert uuid.UUID(again).version == 8


@pytest.fixture
def forget_declared() -> Iterator[None]:
    before = list(consumers.declared)
    yield
    consumers.declared[:] = before


@pytest.mark.parametrize("setting", ["acks_late", "reject_on_worker_lost"])
def test_the_check_refuses_an_exactly_once_task_that_turns_off_late_acks(
    setting: str, forget_declared: None
) -> None:
    assert not [m for m in checks.run_checks() if m.id == "django_idempotency.E010"]
    type("Careless", (ExactlyOnceTask,), {"name": "tests.consumers.careless", setting: False})
    errors = [m for m in checks.run_checks() if m.id == "django_idempotency.E010"]
    assert len(errors) == 1
    assert "tests.consumers.careless" in errors[0].msg and setting in errors[0].msg


def test_the_task_declares_late_acks_and_rejection_on_worker_loss() -> None:
    task = note._get_current_object()
    assert task.acks_late is True and task.reject_on_worker_lost is True
    from testproject.payments.tasks import post_ledger_entry

    assert post_ledger_entry.acks_late is True


def test_records_partitions_are_kept_for_the_consumer_ttl_when_it_is_longer() -> None:
    from django_idempotency.partitions.tables import RECORDS

    with override_settings(
        IDEMPOTENCY_MAX_TTL=timedelta(days=1),
        IDEMPOTENCY_CONSUMER_TTL=timedelta(days=7),
        IDEMPOTENCY_EXPIRED_WINDOW=timedelta(0),
        IDEMPOTENCY_PARTITION_GRACE=timedelta(hours=1),
    ):
        assert RECORDS.keep_for() == timedelta(days=7, hours=1)


@shared_task(base=ExactlyOnceTask, bind=True, name="tests.consumers.swallow")
def swallow(self: ExactlyOnceTask, value: int) -> int:
    RAN.append(("swallow", self.request.id, value))
    enqueue_task("tests.consumers.next", (value,))
    from django.db import DatabaseError, connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")
    except DatabaseError:
        pass  # caught without a savepoint: the transaction cannot commit
    return value


def test_a_body_that_broke_its_transaction_fails_and_leaves_nothing() -> None:
    message_id = str(uuid.uuid4())
    failed = deliver(swallow, message_id, 1)
    assert failed.state == "FAILURE" and isinstance(failed.result, RolledBack)
    assert not IdempotencyRecord.objects.exists() and not OutboxMessage.objects.exists()


def test_a_store_that_cannot_be_reached_gives_the_message_back(monkeypatch: Any) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(storage, "claim", unreachable)
    monkeypatch.setattr(consumers, "STORE_DOWN_PAUSE", 0)
    given_back = deliver(note, str(uuid.uuid4()), 7)
    assert given_back.state == "REJECTED" and given_back.result.requeue
    assert RAN == []


@shared_task(base=ExactlyOnceTask, bind=True, name="tests.consumers.lose_database")
def lose_database(self: ExactlyOnceTask, value: int) -> int:
    RAN.append(("lose_database", self.request.id, value))
    if len(RAN) == 1:
        with connection.cursor() as cursor:
            # The server ends the connection mid-body, as a restart or a cut connection does.
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    return value


def test_a_body_that_loses_the_database_gives_the_message_back(monkeypatch: Any) -> None:
    # Acknowledged as failed, the message would be gone: nothing would ever run it again.
    monkeypatch.setattr(consumers, "STORE_DOWN_PAUSE", 0)
    message_id = str(uuid.uuid4())
    given_back = deliver(lose_database, message_id, 7)
    assert given_back.state == "REJECTED" and given_back.result.requeue
    assert not IdempotencyRecord.objects.exists()
    redelivered = deliver(lose_database, message_id, 7)
    assert (redelivered.state, redelivered.result) == ("SUCCESS", 7)
    assert IdempotencyRecord.objects.get().key == message_id


def test_a_body_whose_database_is_gone_when_it_rolls_back_gives_the_message_back(
    monkeypatch: Any,
) -> None:
    # The server is shutting down: the body's connection is cut, and reconnecting to end the
    # transaction fails too (the unit of work reports the store unavailable).
    monkeypatch.setattr(consumers, "STORE_DOWN_PAUSE", 0)
    connect = connection.get_new_connection
    refused: list[bool] = []

    def shutting_down(params: Any) -> Any:
        if RAN and not refused:  # once the body has lost its connection
            refused.append(True)
            raise OperationalError("the database system is shutting down")
        return connect(params)

    monkeypatch.setattr(connection, "get_new_connection", shutting_down)
    message_id = str(uuid.uuid4())
    given_back = deliver(lose_database, message_id, 7)
    assert refused, "the rollback did not reconnect"
    assert given_back.state == "REJECTED" and given_back.result.requeue
    assert not IdempotencyRecord.objects.exists()
    assert deliver(lose_database, message_id, 7).state == "SUCCESS"


@override_settings(IDEMPOTENCY_EXPIRED_WINDOW=timedelta(days=1))
def test_a_message_whose_record_expired_is_acknowledged_without_running_again() -> None:
    message_id = str(uuid.uuid4())
    created = timezone.now() - timedelta(hours=2)
    storage.store(
        "default",
        storage.Finished(
            principal="consumer:tests.consumers.note",
            key=message_id,
            method="TASK",
            path="tests.consumers.note",
            fingerprint={"arguments": arguments_digest((7,), {})},
            created_at=created,
            expires_at=created + timedelta(hours=1),
            code=200,
            headers=[],
            body=b"7",
            body_encoding="",
        ),
        row_id=None,
        commit=False,
    )
    late = deliver(note, message_id, 7)
    assert late.state == "SUCCESS" and late.result is None
    assert RAN == []


@pytest.mark.parametrize(
    ("setting", "value", "check_id"),
    [("IDEMPOTENCY_CONSUMER_TTL", timedelta(0), "E003"), ("IDEMPOTENCY_CONSUMER_WAIT", 5, "E013")],
)
def test_consumer_durations_are_checked(setting: str, value: Any, check_id: str) -> None:
    with override_settings(**{setting: value}):
        errors = [m for m in checks.run_checks() if m.id == f"django_idempotency.{check_id}"]
    assert [setting in m.msg for m in errors] == [True]


def test_a_delivery_at_repeatable_read_runs_nothing_and_keeps_its_message(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The level ALTER DATABASE, ALTER ROLE or libpq's options give every transaction of the
    # worker's connection. The deployment is at fault, not the message: it goes back to the
    # broker (never acknowledged as done) and runs once the database is fixed.
    monkeypatch.setattr(consumers, "STORE_DOWN_PAUSE", 0)
    message_id = str(uuid.uuid4())
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION default_transaction_isolation = 'repeatable read'")
    try:
        refused = deliver(note, message_id, 7)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_isolation")
    assert refused.state == "REJECTED" and refused.result.requeue
    assert RAN == []
    assert not IdempotencyRecord.objects.exists() and not OutboxMessage.objects.exists()
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert error.name == "django_idempotency"
    assert "task tests.messaging.test_consumers.note was not run" in error.getMessage()
    assert "REPEATABLE READ" in error.getMessage() and "READ COMMITTED" in error.getMessage()

    redelivered = deliver(note, message_id, 7)
    assert redelivered.state == "SUCCESS" and [("note", message_id, 7)] == RAN


def test_a_sealed_result_is_replayed_and_one_no_listed_key_opens_goes_back(
    settings, monkeypatch: Any
) -> None:
    import base64
    import os

    monkeypatch.setattr(consumers, "STORE_DOWN_PAUSE", 0)
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [base64.b64encode(os.urandom(32)).decode()]
    message_id = str(uuid.uuid4())
    first = deliver(note, message_id, 7).result
    record = IdempotencyRecord.objects.get()
    assert record.body_encoding.startswith("@")
    assert b'"value"' not in bytes(record.response_body)
    assert deliver(note, message_id, 7).result == first
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [base64.b64encode(os.urandom(32)).decode()]
    again = deliver(note, message_id, 7)
    assert isinstance(again.result, Reject) and again.result.requeue
    assert len(RAN) == 1


def test_a_redelivery_of_an_erased_consumer_record_is_acknowledged_and_not_run() -> None:
    message_id = str(uuid.uuid4())
    deliver(note, message_id, 7)
    assert erase(DEFAULT_DB_ALIAS, "consumer:tests.consumers.note", batch=10) == 1

    again = deliver(note, message_id, 7)

    assert again.state == "SUCCESS" and again.result is None
    assert [("note", message_id, 7)] == RAN
