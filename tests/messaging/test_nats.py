"""The NATS JetStream destination against a private ``nats-server -js`` of its own: the
message id as ``Nats-Msg-Id``, rows marked only once the stream acknowledged them, and a
server killed and started again under a running relay (each id exactly once in the stream),
and a node of a three-node cluster killed under it the same way."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("nats")
from django.db import transaction
from django.test import override_settings

from django_idempotency.messaging.destinations import NATS, Destination, Destinations
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task, leases
from django_idempotency.messaging.relay.loop import PublishFailed, Relay
from django_idempotency.models import OutboxMessage
from tests.support.chain_processes import wait_for
from tests.support.nats_server import NATS_SERVER, NatsCluster, NatsServer
from tests.support.relays import running

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
    pytest.mark.skipif(NATS_SERVER is None, reason="needs nats-server (Debian: nats-server)"),
]


def destinations(server: NatsServer | NatsCluster, **options: Any) -> dict[str, Any]:
    servers = server.servers if isinstance(server, NatsCluster) else [server.url]
    return {
        "default": {
            "BACKEND": NATS,
            "OPTIONS": {"servers": servers, "subject": "outbox.{name}", "ack_timeout": 2,
                        **options},
        }
    }  # fmt: skip


@pytest.fixture
def to_nats(nats_server: NatsServer) -> Iterator[NatsServer]:
    with override_settings(IDEMPOTENCY_OUTBOX_DESTINATIONS=destinations(nats_server)):
        yield nats_server


def enqueue_many(count: int, per_txn: int = 100) -> list[str]:
    ids: list[str] = []
    while len(ids) < count:
        with transaction.atomic():
            for n in range(len(ids), min(count, len(ids) + per_txn)):
                ids.append(enqueue_event("payments.captured", {"charge": n}))
    return ids


def pending() -> int:
    return OutboxMessage.objects.filter(published_at__isnull=True).count()


def test_each_message_is_published_under_its_id_as_nats_msg_id(to_nats: NatsServer) -> None:
    to_nats.add_stream()
    with transaction.atomic():
        event = enqueue_event("payments.captured", {"charge": 7})
        task = enqueue_task("payments.ledger", (7,), {"amount": 2499})
    relay = Relay()
    assert relay.drain() == 2 and pending() == 0
    relay.destinations.close()
    assert to_nats.ids() == {event: 1, task: 1}
    first, second = to_nats.message(1), to_nats.message(2)
    assert (first.subject, json.loads(first.data)) == ("outbox.payments.captured", {"charge": 7})
    assert first.headers["Nats-Msg-Id"] == event
    assert second.subject == "outbox.payments.ledger"
    assert json.loads(second.data) == {"args": [7], "kwargs": {"amount": 2499}}


def test_a_row_published_again_is_dropped_by_the_stream_as_a_duplicate(
    to_nats: NatsServer,
) -> None:
    """A relay that dies between publish and mark publishes again under the same id: the
    stream keeps one copy (guard: NatsDestination sends the message id as Nats-Msg-Id)."""
    to_nats.add_stream()
    ids = enqueue_many(20)
    relay = Relay()
    assert relay.drain() == 20
    # As if the marks never happened: every row goes out a second time.
    OutboxMessage.objects.update(published_at=None)
    assert relay.drain() == 20 and pending() == 0
    relay.destinations.close()
    assert to_nats.ids() == dict.fromkeys(ids, 1)


def test_a_row_is_marked_published_only_once_the_stream_acknowledged_it(
    to_nats: NatsServer,
) -> None:
    """No stream for the subject: nothing acknowledges the publish, so nothing is marked
    (guard: NatsDestination.publish counts as sent only acknowledged messages)."""
    (message_id,) = enqueue_many(1)
    relay = Relay()
    with pytest.raises(PublishFailed, match="NoStreamResponse"):
        relay.drain()
    row = OutboxMessage.objects.get()
    # No fault of the message: not held back, published as soon as the stream is there.
    assert row.published_at is None and row.lease_until is None and row.attempts == 1
    to_nats.add_stream()
    assert relay.drain() == 1
    relay.destinations.close()
    assert to_nats.ids() == {message_id: 1}


def test_a_message_the_stream_refuses_is_held_back_and_the_others_go_on(
    to_nats: NatsServer,
) -> None:
    to_nats.add_stream()
    to_nats.add_stream("OTHER", ["elsewhere.>"])
    with transaction.atomic():
        refused = enqueue_event("elsewhere.refused", {"n": 1})  # lands in another stream
        accepted = enqueue_event("outbox.captured", {"n": 2})
    options = {"subject": "{name}", "stream": "OUTBOX"}
    with override_settings(IDEMPOTENCY_OUTBOX_DESTINATIONS=destinations(to_nats, **options)):
        relay = Relay()
        with pytest.raises(PublishFailed, match="expected stream does not match"):
            relay.drain()
        relay.destinations.close()
    assert OutboxMessage.objects.get(id=accepted).published_at is not None
    row = OutboxMessage.objects.get(id=refused)
    # The message's own fault: held back with a backoff, its error kept.
    assert row.published_at is None and row.attempts == 1 and row.lease_until is not None
    assert "BadRequestError" in row.last_error
    assert to_nats.ids() == {accepted: 1}


def test_a_nats_server_killed_and_started_again_under_a_running_relay_loses_nothing(
    to_nats: NatsServer,
) -> None:
    to_nats.add_stream()
    ids = publish_through(to_nats.stop, to_nats.start, count=1500)
    found = to_nats.ids()
    assert set(found) == set(ids), (len(found), len(ids))
    assert [i for i, n in found.items() if n != 1] == []


def test_a_cluster_node_killed_and_started_again_under_a_running_relay_loses_nothing(
    nats_cluster: NatsCluster,
) -> None:
    """Three nodes, the stream replicated on each: its leader killed with ``kill -9`` while
    the relay publishes, the other two elect another and go on; the node comes back on its
    store. Each id is in the stream once."""
    nats_cluster.add_stream()
    killed: list[NatsServer] = []

    def kill() -> None:
        killed.append(nats_cluster.leader())
        killed[0].stop()

    with override_settings(IDEMPOTENCY_OUTBOX_DESTINATIONS=destinations(nats_cluster)):
        ids = publish_through(kill, nats_cluster.start, count=600)
    found = nats_cluster.ids()
    assert set(found) == set(ids), (len(found), len(ids))
    assert [i for i, n in found.items() if n != 1] == []
    assert killed[0].running()


def publish_through(kill: Callable[[], None], restart: Callable[[], Any], count: int) -> list[str]:
    """``count`` messages written in transactions of 25 while a relay runs, the server
    killed after the first fifth and started again once more than 50 wait; their ids."""
    ids: list[str] = []
    relay = Relay(batch_size=50)
    stop = threading.Event()

    def writer() -> None:
        from django.db import connection

        try:
            while not stop.is_set() and len(ids) < count:
                ids.extend(enqueue_many(25, per_txn=25))
                time.sleep(0.005)
        finally:
            connection.close()

    with running(relay):
        thread = threading.Thread(target=writer)
        thread.start()
        wait_for(lambda: len(ids) >= count // 5, timeout=60)
        kill()  # kill -9, rows still being written
        wait_for(lambda: pending() > 50, timeout=60)
        time.sleep(1)
        restart()  # the same store: the stream and what it acknowledged
        thread.join(timeout=120)
        stop.set()
        wait_for(lambda: pending() == 0, timeout=90, every=0.2)
    assert len(ids) == count
    return ids


@override_settings(
    IDEMPOTENCY_OUTBOX_DESTINATIONS={
        "default": {"BACKEND": "tests.messaging.test_nats.Recorder"},
        "stream": {"BACKEND": NATS},
    },
    IDEMPOTENCY_OUTBOX_ROUTES={"task:payments.*": "stream", "event:*": "stream"},
)
def test_routes_choose_a_destination_by_kind_and_name() -> None:
    chosen = Destinations()
    stream = chosen.by_name["stream"]

    def message(kind: int, name: str) -> leases.Message:
        return leases.Message("id", None, kind, name, [], {}, None, {})  # type: ignore[arg-type]

    task, event = OutboxMessage.Kind.TASK, OutboxMessage.Kind.EVENT
    assert chosen.of(message(task, "payments.ledger")) is stream
    assert chosen.of(message(event, "anything")) is stream
    assert chosen.of(message(task, "mail.receipt")) is chosen.by_name["default"]
    batch = [message(task, "mail.a"), message(event, "x"), message(task, "mail.b")]
    assert [(d.name, [m.name for m in group]) for d, group in chosen.split(batch)] == [
        ("default", ["mail.a", "mail.b"]),
        ("stream", ["x"]),
    ]


class Recorder(Destination):
    """A destination that keeps what it is given (tests)."""

    redrives = False

    def __init__(self, name: str, options: Any, *, app: Any = None) -> None:
        self.name = name
