"""The relay's publish path: the messages it builds are the ones ``app.send_task()`` builds.

Each test publishes outbox rows with the relay, then the same rows with ``app.send_task()`` as
the relay used to (one call per row, on one producer), on a private ``redis-server``, and
compares what arrived in every queue, byte for byte but kombu's per-push delivery tag.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("celery")
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.utils.saferepr import saferepr
from django.db import connection, transaction
from kombu import Exchange, Queue
from kombu.common import Broadcast

from django_idempotency.conf import conf
from django_idempotency.messaging.destinations.celery_broker import argument_repr
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task
from django_idempotency.messaging.relay.loop import PublishFailed, Relay
from django_idempotency.models import OutboxMessage
from tests.messaging.test_relay import RedisServer, enqueue_many, make_app, wait_for

pytestmark = [pytest.mark.timeout(120)]


on_the_database = pytest.mark.django_db(transaction=True)
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


# argsrepr and kwargsrepr -------------------------------------------------------------------


def json_value(rnd: random.Random, depth: int = 0) -> Any:
    """Arguments as the relay reads them: JSON, with quotes, backslashes, control and
    non-ASCII characters, nesting and lengths either side of Celery's limits."""
    pick = rnd.random()
    if depth < 5 and pick < 0.25:
        return [json_value(rnd, depth + 1) for _ in range(rnd.randint(0, 5))]
    if depth < 5 and pick < 0.45:
        return {text(rnd): json_value(rnd, depth + 1) for _ in range(rnd.randint(0, 5))}
    return rnd.choice(
        [
            lambda: rnd.randint(-(10**12), 10**12),
            lambda: rnd.random() * 10 ** rnd.randint(-5, 20),
            lambda: None,
            lambda: rnd.random() < 0.5,
            lambda: text(rnd),
        ]
    )()


def text(rnd: random.Random) -> str:
    odd = ["'", '"', "\\", "\n", "\x00", "é", "€", "\u200b", "[", "{", ", ", " "]
    size = rnd.randint(0, rnd.choice([5, 40, 400]))
    return "".join(rnd.choice(odd if rnd.random() < 0.2 else "abcdefg ") for _ in range(size))


def test_argsrepr_and_kwargsrepr_are_celerys_saferepr_of_json_arguments() -> None:
    rnd = random.Random(20240601)
    checked = took_repr = 0
    for _ in range(3000):
        value = json.loads(json.dumps(json_value(rnd)))
        for args in ([value], {"k": value}, value if isinstance(value, list) else [], ()):
            for maxsize, maxlevels in [(1024, 3), (1024, 0), (64, 1)]:
                ours = argument_repr(args, maxsize, maxlevels)
                assert ours == saferepr(args, maxsize, maxlevels=maxlevels), args
                checked += 1
                took_repr += ours == repr(args)
    # Most arguments take the cheap way; the rest (cut, too deep, odd strings) Celery's.
    assert checked * 0.3 < took_repr < checked


@pytest.mark.parametrize("size", [1021, 1022, 1023, 1024, 1025])
def test_argsrepr_at_the_length_limit_is_cut_as_celery_cuts_it(size: int) -> None:
    for args in (["a" * (size - 4)], [1, "b " * ((size - 7) // 2)], [["c" * (size - 6)]]):
        assert argument_repr(args, 1024, 3) == saferepr(args, 1024, maxlevels=3)


# The messages ------------------------------------------------------------------------------


def arrived(server: RedisServer) -> dict[str, list[dict[str, Any]]]:
    """Every queue's messages, oldest first, less kombu's delivery tag; the queues emptied."""
    client = server.client()
    found = {}
    for key in client.scan_iter():
        if client.type(key) == b"list":
            payloads = [json.loads(raw) for raw in reversed(client.lrange(key, 0, -1))]
            for payload in payloads:
                payload["properties"].pop("delivery_tag")
            found[key.decode()] = payloads
            client.delete(key)
    return found


def send_task_each_row(app: Celery) -> None:
    """What the relay did before it built messages itself: ``send_task()`` per row."""
    with app.connection_for_write() as connection:
        producer = app.amqp.Producer(connection, auto_declare=False)
        for row in OutboxMessage.objects.order_by("created_at"):
            if row.kind == OutboxMessage.Kind.EVENT:
                name, args, kwargs = conf.OUTBOX_EVENT_TASK, [row.name, row.payload], {}
            else:
                name, args, kwargs = row.name, row.args, row.kwargs
            app.send_task(
                name, args=args, kwargs=kwargs, task_id=str(row.id), producer=producer,
                queue=row.options.get("queue"), retry=False, add_to_parent=False,
            )  # fmt: skip


def relay_and_send_task(app: Celery, server: RedisServer) -> tuple[dict[str, Any], ...]:
    assert Relay(app=app).drain() == OutboxMessage.objects.count()
    by_relay = arrived(server)
    send_task_each_row(app)
    return by_relay, arrived(server)


def route_by_amount(name: str, args: Any, kwargs: Any, options: Any, **extra: Any) -> Any:
    # A route that reads the arguments: asked again for every message.
    if name == "tests.relay.record" and isinstance(args[0], int):
        return {"queue": "large" if args[0] >= 100 else "small"}
    return None


ROUTES: dict[str, Callable[[], Any]] = {
    "default": lambda: None,
    "by name": lambda: {
        "tests.relay.record": {"queue": "ledger"},
        # Expiring: kombu declares it before every message, not once per connection.
        "tests.relay.fleeting": {"queue": Queue("fleeting", queue_arguments={"x-expires": 60000})},
        # Declarations the route chose itself (none) are left as they are.
        "tests.relay.undeclared": {"queue": "audit", "declare": []},
        "tests.relay.topic*": {
            "queue": Queue("reports", Exchange("reports", type="topic"), routing_key="reports.#"),
            "routing_key": "reports.daily",
        },
    },
    "by arguments": lambda: (route_by_amount,),
}


@on_the_database
@needs_redis
@pytest.mark.parametrize("routes", ROUTES)
def test_the_relay_publishes_what_send_task_publishes(
    routes: str, private_redis: RedisServer
) -> None:
    app = make_app(private_redis.url)
    app.conf.task_routes = ROUTES[routes]()

    @app.task(name="tests.relay.limited", shared=False, time_limit=30, soft_time_limit=20)
    def limited() -> None:
        pass

    app.finalize()  # registered, so its options apply: send_task() does not finalize

    with transaction.atomic():
        enqueue_task("tests.relay.record", (1, "it's"), {"note": 'say "hi"\n', "n": None})
        enqueue_task("tests.relay.record", (250, "inr"), {"amount": 2499})
        enqueue_task("tests.relay.record", (7,), queue="priority")
        enqueue_task("tests.relay.record", ["x" * 2000])
        enqueue_task("tests.relay.limited")
        enqueue_task("tests.relay.topic.daily", ({"a": {"b": {"c": {"d": 1}}}},))
        enqueue_event("charge.settled", {"charge": 7, "amount": 2499})
        enqueue_task("tests.relay.fleeting", (1,))
        enqueue_task("tests.relay.fleeting", (2,))
        enqueue_task("tests.relay.undeclared", (3,))
    by_relay, by_send_task = relay_and_send_task(app, private_redis)
    assert by_relay == by_send_task
    counts = {queue: len(messages) for queue, messages in by_relay.items()}
    expected = {
        "default": {"celery": 9, "priority": 1},
        "by name": {
            **{"ledger": 3, "reports": 1, "fleeting": 2, "audit": 1},
            **{"celery": 2, "priority": 1},
        },
        "by arguments": {"small": 1, "large": 1, "celery": 7, "priority": 1},
    }[routes]
    assert counts == expected


@on_the_database
@needs_redis
def test_a_task_with_expires_or_an_eta_is_sent_by_send_task_itself(
    private_redis: RedisServer,
) -> None:
    app = make_app(private_redis.url)

    @app.task(name="tests.relay.expiring", shared=False, expires=600)
    def expiring() -> None:
        pass

    app.finalize()

    with transaction.atomic():
        expiring_id = enqueue_task("tests.relay.expiring")
        later_id = enqueue_task("tests.relay.record", (1,), countdown=30)
    assert Relay(app=app).drain() == 2
    expiring_headers, later_headers = [m["headers"] for m in arrived(private_redis)["celery"]]
    assert expiring_headers["id"] == expiring_id and expiring_headers["expires"]
    assert later_headers["id"] == later_id and later_headers["eta"]


@on_the_database
@needs_redis
def test_a_broker_lost_between_passes_is_kombus_error_as_from_send_task_and_holds_nothing_back(
    private_redis: RedisServer,
) -> None:
    ids = enqueue_many(2)
    relay = Relay(app=make_app(private_redis.url))
    relay.destinations.by_name["default"].broker.producer()  # connected, then the broker goes
    private_redis.stop()
    try:
        with pytest.raises(PublishFailed, match="OperationalError"):
            relay.drain()
    finally:
        private_redis.start()
    first = OutboxMessage.objects.get(id=ids[0])
    assert first.attempts == 1 and first.lease_until is None  # no fault of the message
    assert relay.drain() == 2
    assert [h["id"] for h in private_redis.queued()] == ids


@on_the_database
@needs_redis
def test_the_relay_does_not_listen_for_results_it_never_reads(private_redis: RedisServer) -> None:
    # send_task() has a Redis result backend subscribe to each task's result (and unsubscribe
    # once the result object is gone), for a caller that waits: the relay never waits.
    app = make_app(private_redis.url)
    app.conf.update(result_backend=private_redis.url.replace("/0", "/1"), task_ignore_result=False)
    enqueue_many(3)
    assert Relay(app=app).drain() == 3
    assert "cmdstat_subscribe" not in private_redis.client().info("commandstats")
    assert [h["ignore_result"] for h in private_redis.queued()] == [None] * 3


@on_the_database
@needs_redis
def test_a_broadcast_queue_is_handed_on_undeclared_as_send_task_hands_it_on(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(private_redis.url)
    app.conf.task_queues = (Broadcast("announcements"), Queue("celery"))
    app.conf.task_routes = {"tests.relay.announce": {"queue": "announcements"}}
    handed: list[tuple[str, dict[str, Any]]] = []

    def record(producer: Any, name: str, message: Any, **options: Any) -> None:
        handed.append((message.headers["id"], options))

    monkeypatch.setattr(app.amqp, "send_task_message", record)
    with transaction.atomic():
        message_id = enqueue_task("tests.relay.announce")
    Relay(app=app).drain()
    send_task_each_row(app)
    (by_relay, by_send_task) = handed
    assert by_relay[0] == by_send_task[0] == message_id
    assert by_relay[1]["queue"] is by_send_task[1]["queue"]  # the Broadcast itself, unbound
    assert "declare" not in by_relay[1] and "declare" not in by_send_task[1]


@on_the_database
@needs_redis
def test_inside_a_workers_task_the_messages_are_that_tasks_children(
    private_redis: RedisServer,
) -> None:
    app = make_app(private_redis.url)
    ran: list[str] = []

    @app.task(name="tests.relay.relaying", bind=True, shared=False)
    def relaying(self: Any) -> int:
        ran.append(self.request.id)
        try:
            return Relay(app=app).drain()
        finally:
            connection.close()  # the worker's thread, not the test's

    with transaction.atomic():
        child_id = enqueue_task("tests.relay.record", (3,), queue="elsewhere")
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        relaying.delay()
        (headers,) = wait_for(lambda: private_redis.queued("elsewhere"))
    assert headers["id"] == child_id
    assert headers["parent_id"] == headers["root_id"] == ran[0]


# RabbitMQ ----------------------------------------------------------------------------------


@pytest.fixture
def rabbitmq() -> Iterator[Celery]:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            pass
    except OSError:
        pytest.skip("no RabbitMQ on 127.0.0.1:5672")
    yield make_app("amqp://guest:guest@127.0.0.1:5672//")


@on_the_database
def test_on_rabbitmq_queues_nobody_declared_are_declared_once_per_connection(
    rabbitmq: Celery,
) -> None:
    routed, named = (f"outbox-test-{uuid.uuid4().hex}" for _ in range(2))
    rabbitmq.conf.task_routes = {"tests.relay.record": {"queue": routed}}

    def enqueue_three() -> list[str]:
        with transaction.atomic():
            return [
                enqueue_task("tests.relay.record", (1,)),
                enqueue_task("tests.relay.other", (2,), queue=named),
                enqueue_task("tests.relay.record", (3,)),
            ]

    def taken(queue: str, count: int) -> list[str]:
        with rabbitmq.connection_for_read() as conn:
            simple = conn.SimpleQueue(queue)
            ids = []
            for _ in range(count):
                message = simple.get(timeout=5)
                ids.append(message.headers["id"])
                message.ack()
            assert simple.qsize() == 0
            simple.close()
            return ids

    relay = Relay(app=rabbitmq)
    try:
        first = enqueue_three()
        assert relay.drain() == 3
        assert taken(routed, 2) == [first[0], first[2]] and taken(named, 1) == [first[1]]
        # Deleted behind the relay's back: its next connection declares them again.
        with rabbitmq.connection_for_write() as conn:
            for queue in (routed, named):
                conn.default_channel.queue_delete(queue)
        relay.destinations.by_name["default"].broker.close()
        second = enqueue_three()
        assert relay.drain() == 3
        assert taken(routed, 2) == [second[0], second[2]] and taken(named, 1) == [second[1]]
    finally:
        relay.destinations.by_name["default"].broker.close()
        with rabbitmq.connection_for_write() as conn:
            for queue in (routed, named):
                conn.default_channel.queue_delete(queue)
