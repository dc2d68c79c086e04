"""The redrive: a published message for an exactly-once task that its consumer never recorded
(the broker lost it) is published again, with the same task id, and runs once.

Against a private ``redis-server`` per test whose queue is emptied by hand (the broker losing
what it accepted) and a real Celery worker running an exactly-once task.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("celery")
from celery import Celery
from celery.contrib.testing.worker import start_worker
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.messaging.consumers.celery import ExactlyOnceTask, consumer_principal
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task, leases
from django_idempotency.messaging.relay.loop import Relay
from django_idempotency.messaging.relay.redrive import RedriveResult
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from tests.factories import ConsumerRecordFactory
from tests.messaging.test_relay import bare_app, run_on_sqlite
from tests.support.chain_processes import QUEUE, RedisServer, wait_for
from tests.support.relays import running

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

EXACTLY_ONCE = "tests.redrive.post"
PLAIN = "tests.redrive.plain"
SOON = timedelta(seconds=1)

# What the worker ran: (task name, task id, value).
RAN: list[tuple[str, str, Any]] = []


def make_app(broker: str) -> Celery:
    app = bare_app(broker, "redrive-tests")

    @app.task(name=EXACTLY_ONCE, base=ExactlyOnceTask, bind=True, shared=False)
    def post(self: Any, value: Any) -> Any:
        RAN.append((EXACTLY_ONCE, self.request.id, value))
        return {"value": value}

    @app.task(name=PLAIN, bind=True, shared=False)
    def plain(self: Any, value: Any) -> None:
        RAN.append((PLAIN, self.request.id, value))

    @app.task(name="django_idempotency.event", base=ExactlyOnceTask, bind=True, shared=False)
    def event(self: Any, topic: str, payload: Any) -> None:
        RAN.append(("event", self.request.id, payload))

    return app


@pytest.fixture(autouse=True)
def nothing_ran_yet() -> None:
    RAN.clear()


@pytest.fixture
def app(private_redis: RedisServer) -> Celery:
    return make_app(private_redis.url)


@pytest.fixture
def relay(app: Celery) -> Relay:
    return Relay(app=app)


def enqueue(name: str = EXACTLY_ONCE, value: Any = 7, **options: Any) -> str:
    with transaction.atomic():
        return enqueue_task(name, (value,), **options)


def lose_everything(broker: RedisServer) -> None:
    """The broker loses what it accepted (a Redis without persistence restarted)."""
    broker.client().delete(QUEUE)


def check_when_due(relay: Relay, timeout: float = 10) -> RedriveResult:
    """Run the redrive's pass until it finds rows due a check, and return what it did."""
    results: list[RedriveResult] = []

    def due() -> bool:
        results.append(relay.redrive.run_pass(100))
        return results[-1].checked > 0

    wait_for(due, timeout=timeout, every=0.05)
    return results[-1]


def seconds(delta: timedelta | None) -> float:
    assert delta is not None
    return delta.total_seconds()


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON)
def test_a_message_the_broker_lost_is_published_again_and_its_consumer_runs_it_once(
    app: Celery, relay: Relay, private_redis: RedisServer
) -> None:
    message_id = enqueue()
    assert relay.drain() == 1
    row = OutboxMessage.objects.get()
    assert row.published_at is not None and row.redrive_at is not None
    assert 0.9 <= seconds(row.redrive_at - row.published_at) <= 1.5
    lose_everything(private_redis)
    assert relay.redrive.run_pass(100).checked == 0  # not due yet

    sent: list[dict[str, Any]] = []

    def heard(sender: Any, **kwargs: Any) -> None:
        sent.append(kwargs)

    signals.outbox_redriven.connect(heard)
    try:
        result = check_when_due(relay)
    finally:
        signals.outbox_redriven.disconnect(heard)
    assert result.republished == [message_id] and result.consumed == 0
    assert [(s["ids"], s["using"]) for s in sent] == [([message_id], "default")]
    row.refresh_from_db()
    assert row.published_at is None and row.redrive_at is None and row.redrives == 1
    assert "published again" in row.last_error
    assert relay.drain() == 1
    assert [h["id"] for h in private_redis.queued()] == [message_id]
    row.refresh_from_db()
    # The next check waits twice as long.
    assert 1.9 <= seconds(row.redrive_at - row.published_at) <= 2.5

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        wait_for(lambda: IdempotencyRecord.objects.filter(key=message_id).exists())
    result = check_when_due(relay)
    assert (result.consumed, result.republished) == (1, [])
    row.refresh_from_db()
    assert row.published_at is not None and row.redrive_at is None and row.redrives == 1
    assert [(EXACTLY_ONCE, message_id, 7)] == RAN


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON)
def test_a_message_only_slow_to_be_consumed_is_published_again_and_still_runs_once(
    app: Celery, relay: Relay, private_redis: RedisServer
) -> None:
    message_id = enqueue()
    relay.drain()
    assert check_when_due(relay).republished == [message_id]  # no worker yet
    relay.drain()
    assert [h["id"] for h in private_redis.queued()] == [message_id, message_id]
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        wait_for(lambda: not private_redis.queued() and private_redis.in_flight() == (0, 0))
    assert [(EXACTLY_ONCE, message_id, 7)] == RAN
    assert IdempotencyRecord.objects.filter(key=message_id).count() == 1


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=timedelta(milliseconds=500))
def test_a_running_relay_redrives_by_itself_and_the_worker_runs_it(
    app: Celery, relay: Relay, private_redis: RedisServer
) -> None:
    with running(relay):
        message_id = enqueue()
        wait_for(lambda: private_redis.queued())
        lose_everything(private_redis)
        wait_for(lambda: private_redis.queued(), timeout=15)  # published again
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            wait_for(lambda: RAN)
            # Checked again once consumed: nothing more to do for it.
            wait_for(lambda: OutboxMessage.objects.get().redrive_at is None, timeout=15)
    row = OutboxMessage.objects.get()
    assert row.redrives >= 1 and row.published_at is not None
    assert [(EXACTLY_ONCE, message_id, 7)] == RAN


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=timedelta(milliseconds=500))
def test_a_redis_that_keeps_nothing_on_disk_restarted_after_the_publish_loses_nothing(
    tmp_path: Path,
) -> None:
    # As the machine's own Redis runs: no append-only file, no snapshots.
    volatile = RedisServer.on_free_port(tmp_path, options=("--appendonly", "no"))
    volatile.start()
    try:
        app = make_app(volatile.url)
        relay = Relay(app=app)
        with running(relay):
            message_id = enqueue()
            wait_for(lambda: volatile.queued())
            volatile.stop()
            volatile.start()
            assert volatile.queued() == []  # the restart lost it
            wait_for(lambda: volatile.queued(), timeout=15)  # the redrive published it again
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            wait_for(lambda: RAN)
    finally:
        volatile.stop()
    assert [(EXACTLY_ONCE, message_id, 7)] == RAN


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON)
def test_messages_for_plain_or_unknown_tasks_are_never_checked_nor_published_again(
    relay: Relay, private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="django_idempotency.relay"):
        enqueue(PLAIN)
        enqueue("tests.redrive.nobody_knows")
        assert relay.drain() == 2
    assert list(OutboxMessage.objects.values_list("redrive_at", flat=True)) == [None, None]
    assert "tests.redrive.nobody_knows is not registered" in caplog.text
    lose_everything(private_redis)
    time.sleep(1.1)
    assert relay.redrive_if_due() == 0 and relay.drain() == 0


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON)
def test_an_event_is_checked_when_the_event_task_is_exactly_once(app: Celery, relay: Relay) -> None:
    with transaction.atomic():
        enqueue_event("charge.settled", {"charge": 7})
    relay.drain()
    assert OutboxMessage.objects.get().redrive_at is not None
    principal = consumer_principal(app.tasks["django_idempotency.event"])
    assert relay.redrive.principal(OutboxMessage.Kind.EVENT, "charge.settled") == principal


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=timedelta(minutes=10))
def test_the_check_waits_for_a_countdown_and_doubles_with_each_redrive(relay: Relay) -> None:
    later = enqueue(countdown=3600)
    again = enqueue()
    OutboxMessage.objects.filter(pk=again).update(redrives=3)
    relay.drain()
    rows = {str(r.pk): r for r in OutboxMessage.objects.all()}
    eta = rows[later].created_at + timedelta(hours=1)
    assert abs(seconds(rows[later].redrive_at - eta) - 600) < 5
    assert abs(seconds(rows[again].redrive_at - rows[again].published_at) - 8 * 600) < 5


@pytest.mark.parametrize("why", ["limit", "older than the consumer records"])
@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON, IDEMPOTENCY_OUTBOX_REDRIVE_LIMIT=2)
def test_it_gives_up_after_the_limit_or_past_the_records_retention_and_says_so(
    relay: Relay, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    message_id = enqueue()
    relay.drain()
    past = timezone.now() - timedelta(seconds=1)
    row = OutboxMessage.objects.filter(pk=message_id)
    if why == "limit":
        row.update(redrives=2, redrive_at=past)
    else:
        row.update(redrive_at=past)
    ttl = timedelta(days=7) if why == "limit" else timedelta(milliseconds=1)
    with (
        override_settings(IDEMPOTENCY_CONSUMER_TTL=ttl),
        caplog.at_level(logging.ERROR, logger="django_idempotency.relay"),
    ):
        result = relay.redrive.run_pass(100)
    assert (result.given_up, result.republished) == ([message_id], [])
    # A dead letter: unpublished (kept, counted), never claimed until it is requeued.
    found = row.get()
    assert found.published_at is None and found.redrive_at is None
    assert found.dead_at is not None
    assert "a dead letter" in found.last_error
    assert "dead letters now" in caplog.text and message_id in caplog.text
    assert leases.dead_letters("default", 10) == 1
    assert relay.drain() == 0
    assert leases.requeue("default", [message_id]) == 1
    assert (row.get().dead_at, row.get().redrives) == (None, 0)
    assert relay.drain() == 1
    assert row.get().published_at is not None


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON)
def test_a_message_its_consumer_recorded_is_done_with_and_not_published_again(
    relay: Relay,
) -> None:
    recorded, lost = enqueue(), enqueue()
    relay.drain()
    ConsumerRecordFactory(task=EXACTLY_ONCE, key=recorded)
    ConsumerRecordFactory(task=PLAIN, key=lost)  # another consumer's record of that id
    OutboxMessage.objects.update(redrive_at=timezone.now() - timedelta(seconds=1))
    result = relay.redrive.run_pass(100)
    assert (result.consumed, result.republished, result.given_up) == (1, [lost], [])
    assert OutboxMessage.objects.get(pk=recorded).redrive_at is None


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=None)
def test_none_turns_the_redrive_off(relay: Relay) -> None:
    enqueue()
    relay.drain()
    assert OutboxMessage.objects.get().redrive_at is None
    assert relay.redrive_if_due() == 0


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON)
def test_two_relays_checking_at_once_put_each_message_back_once(app: Celery) -> None:
    with transaction.atomic():
        ids = {enqueue_task(EXACTLY_ONCE, (n,)) for n in range(300)}
    assert Relay(app=app).drain() == 300
    OutboxMessage.objects.update(redrive_at=timezone.now() - timedelta(seconds=1))
    relays = [Relay(app=app, owner=f"relay-{n}") for n in range(2)]
    found: list[list[str]] = [[], []]
    start = threading.Barrier(2)

    def check(n: int) -> None:
        start.wait()
        try:
            while result := relays[n].redrive.run_pass(40):
                if not result.checked:
                    break
                found[n] += result.republished
        finally:
            connection.close()

    threads = [threading.Thread(target=check, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    both = found[0] + found[1]
    assert sorted(both) == sorted(ids) and found[0] and found[1]
    assert set(OutboxMessage.objects.values_list("redrives", flat=True)) == {1}


SQLITE_SCRIPT = """
import json, sys, django
django.setup()
from datetime import timedelta
from celery import Celery
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from django_idempotency.messaging.consumers.celery import ExactlyOnceTask
from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.messaging.relay.loop import Relay
from django_idempotency.models import OutboxMessage

call_command("migrate", verbosity=0)
app = Celery("sqlite-redrive", set_as_current=False)
app.conf.update(broker_url=sys.argv[1], task_ignore_result=True)


@app.task(name="tests.redrive.post", base=ExactlyOnceTask, shared=False)
def post(value):
    return value


with override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=timedelta(minutes=10)):
    with transaction.atomic():
        first = enqueue_task("tests.redrive.post", (1,), countdown=60)
    relay = Relay(app=app)
    relay.drain()
    row = OutboxMessage.objects.get()
    waits = (row.redrive_at - row.created_at).total_seconds()
    OutboxMessage.objects.update(redrive_at=timezone.now() - timedelta(seconds=1))
    again = relay.redrive.run_pass(100).republished
    pending = OutboxMessage.objects.filter(published_at__isnull=True).count()
    relay.drain()
    row = OutboxMessage.objects.get()
print(json.dumps({
    "waits": waits, "again": again, "first": first, "pending": pending,
    "redrives": row.redrives, "waits_again": (row.redrive_at - row.created_at).total_seconds(),
}))
"""


def test_on_sqlite_the_redrive_checks_and_publishes_again(
    tmp_path: Path, private_redis: RedisServer
) -> None:
    result = run_on_sqlite(tmp_path, SQLITE_SCRIPT, private_redis.url)
    assert abs(result["waits"] - 660) < 5  # its countdown, then REDRIVE_AFTER
    assert result["again"] == [result["first"]] and result["pending"] == 1
    assert result["redrives"] == 1 and abs(result["waits_again"] - 1260) < 5  # doubled


CELERY = {"BACKEND": "django_idempotency.messaging.destinations.celery.CeleryDestination"}
TASKS = {"BACKEND": "django_idempotency.messaging.destinations.tasks.TasksDestination"}


@pytest.mark.parametrize(
    "destinations",
    [{"tasks": TASKS, "default": CELERY}, {"default": CELERY, "tasks": TASKS}],
    ids=["tasks-listed-first", "celery-listed-first"],
)
@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=SOON)
def test_the_redrive_checks_celery_consumers_whatever_the_order_of_the_destinations(
    app: Celery, private_redis: RedisServer, destinations: dict[str, Any]
) -> None:
    # A redriving destination without a Celery app (Django Tasks) listed before the Celery
    # one once left the relay without an app to ask: a message the broker lost stayed lost.
    with override_settings(IDEMPOTENCY_OUTBOX_DESTINATIONS=destinations):
        relay = Relay(app=app)
        message_id = enqueue()
        assert relay.drain() == 1
        assert OutboxMessage.objects.get().redrive_at is not None
        lose_everything(private_redis)
        result = check_when_due(relay)
    assert result.republished == [message_id]
    expected = consumer_principal(app.tasks[EXACTLY_ONCE])
    assert relay.redrive.principal(OutboxMessage.Kind.TASK, EXACTLY_ONCE) == expected
