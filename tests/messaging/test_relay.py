"""The relay, against a real broker: a private ``redis-server`` per test (never the machine's),
RabbitMQ for publisher confirms, a real worker, and relays as processes that get killed.

In-process tests run ``Relay`` directly; the crash, concurrency, restart and wake-up tests run
``manage.py idempotency_relay`` as a child process on the test database.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("celery")
from celery import Celery
from celery.contrib.testing.worker import start_worker
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.messaging.destinations import Destination, PublishResult
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task, leases
from django_idempotency.messaging.relay.loop import PublishFailed, Relay
from django_idempotency.models import OutboxMessage
from tests.conftest import ROOT, die_with_parent, unmeasured
from tests.support.chain_processes import QUEUE, RedisServer, wait_for
from tests.support.servers import free_port

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


# What the worker ran: (task id, args, kwargs), in the worker's order.
RAN: list[tuple[str, list[Any], dict[str, Any]]] = []


def bare_app(broker: str, name: str = "relay-tests") -> Celery:
    """A Celery app of its own on ``broker``, with no tasks yet."""
    app = Celery(f"{name}-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # An in-process worker (start_worker) stops when its loop next wakes: waiting on
        # Redis 0.1 s at a time rather than 1 s stops it in 0.1 s, not 0.7 s. A message is
        # taken as soon as it arrives either way.
        broker_transport_options={"polling_interval": 0.1},
    )
    return app


def make_app(broker: str) -> Celery:
    app = bare_app(broker)

    @app.task(name="tests.relay.record", bind=True, shared=False)
    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        RAN.append((self.request.id, list(args), kwargs))

    @app.task(name="django_idempotency.event", bind=True, shared=False)
    def event(self: Any, topic: str, payload: dict[str, Any]) -> None:
        RAN.append((self.request.id, [topic, payload], {}))

    return app


@pytest.fixture
def app(private_redis: RedisServer) -> Celery:
    RAN.clear()
    return make_app(private_redis.url)


@pytest.fixture
def worker(app: Celery, django_db_blocker: Any) -> Iterator[Any]:
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30) as w:
        yield w


def enqueue_many(count: int, name: str = "tests.relay.record", per_txn: int = 500) -> list[str]:
    ids: list[str] = []
    while len(ids) < count:
        with transaction.atomic():
            for n in range(len(ids), min(count, len(ids) + per_txn)):
                ids.append(enqueue_task(name, (n,)))
    return ids


def pending() -> int:
    return OutboxMessage.objects.filter(published_at__isnull=True).count()


@contextlib.contextmanager
def timed_statement(sql: str) -> Iterator[list[datetime]]:
    """When the one run of ``sql`` in the block started and ended, by the app's clock."""
    times: list[datetime] = []

    def timed(execute: Callable[..., Any], statement: str, *args: Any) -> Any:
        if statement != sql:
            return execute(statement, *args)
        times.append(timezone.now())
        try:
            return execute(statement, *args)
        finally:
            times.append(timezone.now())

    with connection.execute_wrapper(timed):
        yield times
    assert len(times) == 2, f"{sql!r} ran {len(times) // 2} times"


# In-process ---------------------------------------------------------------------------


def test_a_committed_task_is_published_with_its_message_id_and_the_worker_runs_it(
    app: Celery, worker: Any
) -> None:
    with transaction.atomic():
        message_id = enqueue_task("tests.relay.record", (1, "inr"), {"amount": 2499})
    assert Relay(app=app).drain() == 1
    wait_for(lambda: RAN)
    assert [(message_id, [1, "inr"], {"amount": 2499})] == RAN
    row = OutboxMessage.objects.get()
    assert row.published_at is not None and row.attempts == 0 and row.last_error == ""


def test_a_rolled_back_transaction_publishes_nothing(
    app: Celery, private_redis: RedisServer
) -> None:
    with contextlib.suppress(ZeroDivisionError), transaction.atomic():
        enqueue_task("tests.relay.record", (1,))
        1 / 0  # noqa: B018
    assert Relay(app=app).drain() == 0
    assert private_redis.queued() == [] and not OutboxMessage.objects.exists()


def test_an_event_is_published_as_the_event_task_with_topic_and_payload(
    app: Celery, worker: Any
) -> None:
    with transaction.atomic():
        message_id = enqueue_event("charge.settled", {"charge": 7})
    Relay(app=app).drain()
    wait_for(lambda: RAN)
    assert [(message_id, ["charge.settled", {"charge": 7}], {})] == RAN


def test_queue_and_countdown_are_applied_and_the_eta_counts_from_the_enqueue(
    app: Celery, private_redis: RedisServer
) -> None:
    with transaction.atomic():
        message_id = enqueue_task("tests.relay.record", queue="ledger", countdown=60)
    Relay(app=app).drain()
    (headers,) = private_redis.queued("ledger")
    row = OutboxMessage.objects.get()
    assert headers["id"] == message_id
    assert headers["eta"] == (row.created_at + timedelta(seconds=60)).isoformat()


def test_rows_are_published_in_the_order_they_were_written_by_one_relay(
    app: Celery, private_redis: RedisServer
) -> None:
    ids = enqueue_many(120, per_txn=7)
    assert Relay(app=app, batch_size=25).drain() == 120
    assert [h["id"] for h in private_redis.queued()] == ids


def test_rows_another_relay_gave_back_are_still_published_in_the_order_they_were_written(
    app: Celery, private_redis: RedisServer
) -> None:
    # A relay that stops between its claim and its publish gives its rows back: updated, they
    # now lie after the others in the table, and only the claim's ORDER BY keeps them first.
    ids = enqueue_many(120, per_txn=7)
    stopping = Relay(app=app, batch_size=50)
    batch = stopping.claim()
    stopping.release(batch, batch.messages)
    assert Relay(app=app, batch_size=25).drain() == 120
    assert [h["id"] for h in private_redis.queued()] == ids


def test_the_published_signal_names_the_ids_outside_any_transaction(app: Celery) -> None:
    sent: list[tuple[list[str], str, bool]] = []

    def receiver(sender: Any, ids: list[str], using: str, **kwargs: Any) -> None:
        sent.append((ids, using, connection.in_atomic_block))

    ids = enqueue_many(3)
    signals.outbox_published.connect(receiver)
    try:
        Relay(app=app).drain()
    finally:
        signals.outbox_published.disconnect(receiver)
    assert sent == [(ids, "default", False)]


def test_a_relay_whose_lease_expired_cannot_mark_rows(
    app: Celery, private_redis: RedisServer
) -> None:
    ids = enqueue_many(5)
    slow, fast = Relay(app=app, owner="slow"), Relay(app=app, owner="fast")
    stalled = slow.claim()
    assert [m.id for m in stalled.messages] == ids
    assert fast.claim().messages == ()  # leased: nobody else takes them meanwhile
    # The slow relay's lease runs out (made so, rather than waited for: a busy machine may
    # stall any relay past a short lease, the fast one too).
    OutboxMessage.objects.update(lease_until=timezone.now() - timedelta(seconds=1))
    # Lease run out, nobody took over yet: still no mark (the fence alone would allow it).
    assert slow.mark(stalled, stalled.messages[:1]) == 0
    taken = fast.claim()
    assert [m.id for m in taken.messages] == ids and taken.fence > stalled.fence
    assert slow.mark(stalled, stalled.messages) == 0
    assert fast.mark(taken, taken.messages) == 5
    assert set(OutboxMessage.objects.values_list("lease_owner", flat=True)) == {"fast"}
    assert pending() == 0


# What SlowDestination published, in order.
SLOWLY_PUBLISHED: list[str] = []


class SlowDestination(Destination):
    """A destination that takes a round trip of 0.25 s per message (as RQ takes one per job,
    on a slow link), acknowledging each at once."""

    redrives = False

    def __init__(self, name: str, options: Any, *, app: Any = None) -> None:
        self.name = name

    def open(self) -> None: ...

    def close(self) -> None: ...

    def is_connection_error(self, exc: Exception) -> bool:
        return False

    def describe(self) -> str:
        return "slowly"

    def publish(self, messages: Any, stopping: Any) -> PublishResult:
        done = PublishResult()
        for message in messages:
            if stopping.is_set():
                break
            time.sleep(0.25)
            SLOWLY_PUBLISHED.append(message.id)
            done.sent.append(message)
        return done


@override_settings(
    IDEMPOTENCY_OUTBOX_DESTINATIONS={
        "default": {"BACKEND": "tests.messaging.test_relay.SlowDestination"}
    },
    IDEMPOTENCY_OUTBOX_LEASE=timedelta(seconds=2),
)
def test_a_batch_slower_to_publish_than_its_lease_is_marked_in_parts_not_published_again() -> None:
    # 12 messages take 3 s, longer than the 2 s lease: a relay that published them all before
    # marking would find its lease gone, mark none, and publish the same batch again for ever.
    ids = enqueue_many(12)
    SLOWLY_PUBLISHED.clear()
    relay = Relay()
    passes = 0
    while pending() and passes < 30:
        relay.run_pass()
        passes += 1
    assert pending() == 0
    # Each published once, in order, over several passes that each stopped at half the lease.
    assert ids == SLOWLY_PUBLISHED
    assert passes > 1


def test_a_broker_that_is_down_records_the_attempt_and_the_relay_retries_at_once(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    ids = enqueue_many(3)
    down = make_app(f"redis://127.0.0.1:{free_port()}/0")  # nobody listens there
    with pytest.raises(PublishFailed), caplog.at_level(logging.WARNING, "django_idempotency"):
        Relay(app=down).drain()
    first, *rest = OutboxMessage.objects.order_by("created_at")
    assert str(first.id) == ids[0] and first.attempts == 1 and first.published_at is None
    assert "Error" in first.last_error
    # Not the message's fault: nothing is held back, so all go out once the broker is back.
    assert first.lease_until is None and first.lease_owner == ""
    assert all(r.attempts == 0 and r.lease_until is None for r in rest)  # untried, given back
    assert "Publishing outbox message" in caplog.text
    assert Relay(app=make_app(private_redis.url)).drain() == 3
    assert [h["id"] for h in private_redis.queued()] == ids


def refuse_one_task(name: str, args: Any, kwargs: Any, options: Any, **extra: Any) -> None:
    if name == "tests.relay.unroutable":
        raise ValueError("no route for this one")


def test_a_message_that_fails_to_publish_is_held_back_with_backoff_and_others_go_on(
    private_redis: RedisServer,
) -> None:
    app = make_app(private_redis.url)
    app.conf.task_routes = (refuse_one_task,)
    with transaction.atomic():
        bad = enqueue_task("tests.relay.unroutable")
        good = enqueue_task("tests.relay.record")
    with pytest.raises(PublishFailed, match="no route"):
        Relay(app=app).drain()
    row = OutboxMessage.objects.get(id=bad)
    assert row.attempts == 1 and row.last_error == "ValueError: no route for this one"
    assert row.lease_until is not None  # held back about a second
    assert Relay(app=app).drain() == 1  # the next pass goes past it
    assert [h["id"] for h in private_redis.queued()] == [good]
    time.sleep(1.2)
    with timed_statement(leases.FAIL) as failed_between, pytest.raises(PublishFailed):
        Relay(app=app).drain()
    row.refresh_from_db()
    # Held back from the FAIL statement's own clock (its transaction's now()), not from
    # whenever this test gets the CPU back on a busy machine.
    (started, ended) = failed_between
    assert row.attempts == 2
    assert started + timedelta(seconds=2) <= row.lease_until <= ended + timedelta(seconds=2)
    assert pending() == 1


def test_a_batch_the_broker_refuses_as_a_whole_counts_as_unpublished(
    app: Celery, private_redis: RedisServer
) -> None:
    relay = Relay(app=app)
    (warm_up,) = enqueue_many(1)
    assert relay.drain() == 1  # the queue is declared: what follows is only pushes
    ids = enqueue_many(3)
    private_redis.client().config_set("maxmemory", 1)  # every write now answers OOM
    with pytest.raises(PublishFailed, match="uncertain"):
        relay.drain()
    assert [h["id"] for h in private_redis.queued()] == [warm_up] and pending() == 3
    first, *rest = OutboxMessage.objects.filter(id__in=ids).order_by("created_at")
    assert first.attempts == 1 and "BatchPublishError" in first.last_error
    assert all(r.attempts == 0 and r.lease_until is None and r.lease_owner == "" for r in rest)
    private_redis.client().config_set("maxmemory", 0)
    OutboxMessage.objects.filter(pk=first.pk).update(lease_until=None)
    assert relay.drain() == 3
    assert [h["id"] for h in private_redis.queued()] == [warm_up, *ids]


def test_rabbitmq_publishes_in_confirm_mode(django_db_blocker: Any) -> None:
    rabbit = make_app("amqp://guest:guest@127.0.0.1:5672//")
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            pass
    except OSError:
        pytest.skip("no RabbitMQ on 127.0.0.1:5672")
    queue = f"outbox-test-{uuid.uuid4().hex}"
    with transaction.atomic():
        message_id = enqueue_task("tests.relay.record", (5,), queue=queue)
    relay = Relay(app=rabbit)
    assert rabbit.conf.broker_transport_options["confirm_publish"] is True
    try:
        assert relay.drain() == 1
        channel = relay.destinations.by_name["default"].broker.producer().channel
        assert channel._confirm_selected  # the broker acknowledged each publish
        with rabbit.connection_for_read() as conn:
            simple = conn.SimpleQueue(queue)
            message = simple.get(timeout=5)
            assert message.headers["id"] == message_id
            message.ack()
            simple.close()
            conn.default_channel.queue_delete(queue)
    finally:
        relay.destinations.by_name["default"].broker.close()


@override_settings(IDEMPOTENCY_OUTBOX_MAX_AGE=timedelta(minutes=5))
def test_an_old_backlog_is_logged_and_reported_by_a_database_check(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    from django_idempotency.checks import check_outbox_backlog

    enqueue_many(1)
    assert check_outbox_backlog(None, databases=["default"]) == []
    OutboxMessage.objects.update(created_at=OutboxMessage.objects.get().created_at)
    with connection.cursor() as cursor:
        # Age the row within its partition's day is not enough: move its clock instead.
        cursor.execute(
            "UPDATE django_idempotency_outbox SET created_at = now() - interval '10 minutes'"
        )
    (warning,) = check_outbox_backlog(None, databases=["default"])
    assert warning.id == "django_idempotency.W120" and "idempotency_relay" in warning.hint
    relay = Relay(app=app)
    with caplog.at_level(logging.WARNING, "django_idempotency"):
        relay.warn_if_backlog_is_old()
    assert "oldest unpublished outbox message" in caplog.text


# Child processes ----------------------------------------------------------------------


@pytest.fixture
def relay_env(
    subprocess_env: dict[str, str], private_redis: RedisServer, tmp_path: Path
) -> Callable[..., dict[str, str]]:
    """The environment of a relay process: the test database, the private broker, and
    settings overrides written to a module of their own."""

    def make(**overrides: Any) -> dict[str, str]:
        lines = ["from datetime import timedelta", "from tests.settings import *  # noqa"]
        lines += [f"{name} = {value}" for name, value in overrides.items()]
        module = f"relay_settings_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text("\n".join(lines) + "\n")
        return {
            **subprocess_env,
            "CELERY_BROKER_URL": private_redis.url,
            "DJANGO_SETTINGS_MODULE": module,
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{subprocess_env['PYTHONPATH']}",
        }

    return make


@contextlib.contextmanager
def relay_process(env: dict[str, str], *args: str) -> Iterator[subprocess.Popen[str]]:
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed in the finally below)
    process = subprocess.Popen(
        [sys.executable, "manage.py", "idempotency_relay", *args],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        preexec_fn=die_with_parent,
    )  # fmt: skip
    process.log = log  # type: ignore[attr-defined]
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


def log_of(process: subprocess.Popen[str]) -> str:
    log = process.log  # type: ignore[attr-defined]
    log.seek(0)
    return str(log.read())


def wait_started(process: subprocess.Popen[str]) -> None:
    wait_for(lambda: "started on database" in log_of(process) or process.poll() is not None)
    assert process.poll() is None, log_of(process)
    time.sleep(0.2)  # from "started" to LISTEN


KILL_AFTER_PUBLISH = """
import os, signal, django
django.setup()
from django_idempotency.messaging.relay.loop import Relay
# The broker has the batch (publish_all returned); the relay dies before it can mark it.
Relay.mark = lambda self, batch, messages: os.kill(os.getpid(), signal.SIGKILL)
from django.core.management import call_command
call_command("idempotency_relay", "--once")
"""


def test_a_relay_killed_between_publish_and_mark_publishes_again_with_the_same_id(
    relay_env: Callable[..., dict[str, str]], private_redis: RedisServer
) -> None:
    (message_id,) = enqueue_many(1)
    env = relay_env(IDEMPOTENCY_OUTBOX_LEASE="timedelta(seconds=1)")
    # Not traced by coverage.py (conftest.unmeasured): killed with kill -9, it saves nothing.
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_PUBLISH], cwd=ROOT, env=unmeasured(env),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [h["id"] for h in private_redis.queued()] == [message_id]
    row = OutboxMessage.objects.get()
    assert row.published_at is None and row.lease_owner  # published, never marked
    # The dead relay's lease runs out (made so rather than waited for); the next relay runs
    # with the default lease, which no busy machine outlasts between its claim and its mark.
    OutboxMessage.objects.update(lease_until=timezone.now() - timedelta(seconds=1))
    done = subprocess.run(
        [sys.executable, "manage.py", "idempotency_relay", "--once"], cwd=ROOT, env=relay_env(),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # At least once: twice, under the same task id, so an exactly-once consumer runs it once.
    assert [h["id"] for h in private_redis.queued()] == [message_id, message_id]
    assert pending() == 0


def test_two_relays_at_once_publish_each_of_2000_rows_once(
    relay_env: Callable[..., dict[str, str]], private_redis: RedisServer
) -> None:
    # Not traced by coverage.py (conftest.unmeasured): the other relay processes cover all
    # that these two run, and tracing them slows the publishing of the 2000 rows.
    env = unmeasured(relay_env())
    with (
        relay_process(env, "--batch-size", "20") as one,
        relay_process(env, "--batch-size", "20") as two,
    ):
        wait_started(one)
        wait_started(two)
        ids = enqueue_many(2000, per_txn=100)
        wait_for(lambda: pending() == 0, timeout=120, every=0.1)
    published = [h["id"] for h in private_redis.queued()]
    assert len(published) == 2000 and set(published) == set(ids)
    owners = set(OutboxMessage.objects.values_list("lease_owner", flat=True))
    assert len(owners) == 2, "both relays should have published a share"


def test_the_relay_survives_a_broker_restart_without_losing_a_committed_row(
    relay_env: Callable[..., dict[str, str]], private_redis: RedisServer
) -> None:
    env = relay_env(IDEMPOTENCY_OUTBOX_POLL_INTERVAL="timedelta(milliseconds=500)")
    with relay_process(env) as relay:
        wait_started(relay)
        before = enqueue_many(50)
        wait_for(lambda: pending() == 0)
        private_redis.stop()
        during = enqueue_many(50)
        wait_for(lambda: OutboxMessage.objects.filter(attempts__gt=0).exists())
        private_redis.start()
        after = enqueue_many(50)
        # Held-back rows come back after their backoff (1-2 s here).
        wait_for(lambda: pending() == 0, timeout=60, every=0.1)
        assert relay.poll() is None, log_of(relay)
    published = {h["id"] for h in private_redis.queued()}
    assert published == set(before + during + after)


def test_the_relay_survives_losing_its_database_connections(
    relay_env: Callable[..., dict[str, str]], private_redis: RedisServer
) -> None:
    env = relay_env(
        IDEMPOTENCY_OUTBOX_POLL_INTERVAL="timedelta(milliseconds=500)",
        IDEMPOTENCY_OUTBOX_LEASE="timedelta(seconds=2)",
    )
    with relay_process(env) as relay:
        wait_started(relay)
        first = enqueue_many(20)
        wait_for(lambda: pending() == 0)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert cursor.fetchone()[0] >= 1  # the relay's connections
        second = enqueue_many(20)
        wait_for(lambda: pending() == 0, timeout=60, every=0.1)
        assert relay.poll() is None, log_of(relay)
    assert {h["id"] for h in private_redis.queued()} == set(first + second)


def test_a_listener_lost_as_the_relay_takes_the_rest_of_its_notifies_is_replaced() -> None:
    # A failover right after a commit: its notify is read, then the server is gone as the
    # relay takes the notifies behind it. A failover profile saw the relay die of it.
    class Dying:
        closed = False

        def notifies(self, timeout: float, stop_after: int | None = None) -> Iterator[object]:
            if stop_after is None:
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            yield object()

        def close(self) -> None:
            self.closed = True

    relay, listener = Relay(), Dying()
    relay._listener = listener
    # Woken, it passes and LISTENs again on its next loop, on whichever server is up.
    assert relay.wait(5.0) is True
    assert relay._listener is None and listener.closed


def test_a_commit_wakes_the_relay_within_milliseconds_not_the_poll(
    relay_env: Callable[..., dict[str, str]], private_redis: RedisServer
) -> None:
    env = relay_env(IDEMPOTENCY_OUTBOX_POLL_INTERVAL="timedelta(seconds=60)")
    client = private_redis.client()
    delays = []
    with relay_process(env) as relay:
        wait_started(relay)
        for n in range(10):
            with transaction.atomic():
                enqueue_task("tests.relay.record", (n,))
            committed = time.monotonic()
            assert client.brpop([QUEUE], timeout=10) is not None
            delays.append(time.monotonic() - committed)
    delays.sort()
    assert delays[5] < 0.1, delays  # median
    assert delays[-1] < 1.0, delays  # far below the 60 s poll


def test_the_command_drains_once_and_says_how_many(
    private_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue_many(7)
    with override_settings(
        IDEMPOTENCY_OUTBOX_CELERY_APP="tests.messaging.test_relay.COMMAND_APP", CELERY_BROKER_URL=""
    ):
        COMMAND_APP.conf.broker_url = private_redis.url
        call_command("idempotency_relay", "--once", "--batch-size", "3")
    assert "Published 7 messages." in capsys.readouterr().out
    assert len(private_redis.queued()) == 7 and pending() == 0


COMMAND_APP = make_app("memory://")


SQLITE_SETTINGS = """
SECRET_KEY = "relay-sqlite-tests-only"
INSTALLED_APPS = ["django.contrib.auth", "django.contrib.contenttypes", "django_idempotency"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {name!r}}}}}
USE_TZ = True
"""

SQLITE_SCRIPT = """
import json, sys, django
django.setup()
from celery import Celery
from django.core.management import call_command
from django.db import connection, transaction
from django_idempotency.messaging.outbox import NotInTransaction, enqueue_task
from django_idempotency.messaging.relay.loop import Relay
from django_idempotency.models import OutboxMessage

call_command("migrate", verbosity=0)
app = Celery("sqlite-relay", set_as_current=False)
app.conf.update(broker_url=sys.argv[1], task_ignore_result=True)
try:
    enqueue_task("tests.relay.record")
    refused = False
except NotInTransaction:
    refused = True
with transaction.atomic():
    ids = [enqueue_task("tests.relay.record", (n,)) for n in range(5)]
stale, fresh = Relay(app=app, owner="stale"), Relay(app=app, owner="fresh")
held = stale.claim(limit=2)
OutboxMessage.objects.update(lease_until=None)  # as if the lease ran out
published = fresh.drain()
print(json.dumps({
    "vendor": connection.vendor, "refused": refused, "ids": ids, "published": published,
    "stale_marked": stale.mark(held, held.messages),
    "pending": OutboxMessage.objects.filter(published_at__isnull=True).count(),
}))
"""


def run_on_sqlite(tmp_path: Path, script: str, broker_url: str) -> dict[str, Any]:
    """Run ``script`` in a process of its own on a fresh SQLite database, with the broker's
    URL as its argument; return the JSON its last line printed."""
    (tmp_path / "relay_sqlite_settings.py").write_text(
        SQLITE_SETTINGS.format(name=str(tmp_path / "relay.sqlite3"))
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "relay_sqlite_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    env.pop("DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", script, broker_url], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_on_sqlite_the_outbox_is_a_plain_table_and_the_relay_publishes_it(
    tmp_path: Path, private_redis: RedisServer
) -> None:
    result = run_on_sqlite(tmp_path, SQLITE_SCRIPT, private_redis.url)
    assert result["vendor"] == "sqlite" and result["refused"] is True
    assert result["published"] == 5 and result["pending"] == 0
    assert result["stale_marked"] == 0  # its fence moved on when the other relay took over
    assert [h["id"] for h in private_redis.queued()] == result["ids"]


def test_once_with_the_broker_down_exits_with_an_error_and_publishes_nothing(
    relay_env: Callable[..., dict[str, str]],
) -> None:
    enqueue_many(2)
    env = {**relay_env(), "CELERY_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}
    done = subprocess.run(
        [sys.executable, "manage.py", "idempotency_relay", "--once"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "Publishing failed" in done.stderr
    assert pending() == 2


# A project of the docs' shape, run as its own manage.py -------------------------------------

SHOP_CELERY = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

# No LOGGING: Django's default logging.
SHOP_SETTINGS = """
import os

import dj_database_url

SECRET_KEY = "shop-relay-tests-only"
INSTALLED_APPS = ["django.contrib.auth", "django.contrib.contenttypes", "django_idempotency"]
DATABASES = {"default": dj_database_url.parse(os.environ["DATABASE_URL"])}
USE_TZ = True
CELERY_BROKER_URL = os.environ["CELERY_BROKER_URL"]
IDEMPOTENCY_OUTBOX_CELERY_APP = os.environ.get("SHOP_CELERY_APP") or None
"""

SHOP_MANAGE = """
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""

# The celery.py import that Celery's Django guide puts in the project's __init__.py.
LOADS_CELERY = "from .celery import app as celery_app\n\n__all__ = ['celery_app']\n"


def run_shop_relay(
    tmp_path: Path, subprocess_env: dict[str, str], *, init: str = "", celery_app: str = ""
) -> tuple[subprocess.CompletedProcess[str], str]:
    """``manage.py idempotency_relay --once`` of a project ``shop`` written as the docs show,
    whose package's ``__init__.py`` is ``init``; (what it did, the broker URL's password)."""
    package = tmp_path / "shop"
    package.mkdir()
    (package / "__init__.py").write_text(init)
    (package / "celery.py").write_text(SHOP_CELERY)
    (package / "settings.py").write_text(SHOP_SETTINGS)
    (tmp_path / "manage.py").write_text(SHOP_MANAGE)
    password = uuid.uuid4().hex
    env = {
        **subprocess_env,
        # Nothing listens there: an empty outbox never connects to the broker.
        "CELERY_BROKER_URL": f"redis://:{password}@127.0.0.1:{free_port()}/0",
        "SHOP_CELERY_APP": celery_app,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{subprocess_env['PYTHONPATH']}",
    }
    env.pop("DJANGO_SETTINGS_MODULE")
    done = subprocess.run(
        [sys.executable, "manage.py", "idempotency_relay", "--once"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, password


def test_the_relay_refuses_to_start_with_celerys_default_app_and_says_what_it_found(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    enqueue_many(1)
    # The docs' celery.py, never imported: Celery's own default app is the current one.
    done, password = run_shop_relay(tmp_path, subprocess_env)
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr
    assert "Celery's default app ('default', broker redis://:**@127.0.0.1:" in error, error
    assert "from .celery import app as celery_app" in error
    assert "IDEMPOTENCY_OUTBOX_CELERY_APP" in error
    assert password not in done.stdout + error
    assert "Published" not in done.stdout and pending() == 1


@pytest.mark.parametrize(
    ("init", "celery_app"),
    [(LOADS_CELERY, ""), ("", "shop.celery.app")],
    ids=["loaded-by-the-package", "named-by-the-setting"],
)
def test_the_relay_says_at_start_which_app_and_broker_it_publishes_to_under_djangos_logging(
    tmp_path: Path, subprocess_env: dict[str, str], init: str, celery_app: str
) -> None:
    done, password = run_shop_relay(tmp_path, subprocess_env, init=init, celery_app=celery_app)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Published 0 messages." in done.stdout
    started = [line for line in done.stderr.splitlines() if "started on database" in line]
    assert len(started) == 1, done.stderr
    assert "publishes with Celery app 'shop' to redis://:**@127.0.0.1:" in started[0]
    assert password not in done.stdout + done.stderr
