"""Where a chain profile's relays publish, and what consumes it: one ``ChainDestination`` per
destination (``python -m tests.reliability --profile chain --destination NAME``).

Each names its broker (a private server the profile starts, kills with ``kill -9`` for the
broker-restart fault and starts again on the same data), the settings of the chain's
processes, and its consumer process (killed whole or one pool child at a time).

Built: Celery on a private ``redis-server`` (the suite's chain-short profile), Celery on a
private RabbitMQ node, NATS JetStream (a private ``nats-server -js``; the ledger message routed
to it by ``IDEMPOTENCY_OUTBOX_ROUTES``, consumed by ``manage.py idempotency_consume_nats``), the
same on a three-node JetStream cluster with the stream replicated three times, and
Django's Tasks framework through RQ (a private redis-server; ``manage.py rqworker``). Another
destination is one more entry: its broker behind the ``Broker`` protocol, the settings that
send the charge's ledger posting to it, and its consumer's command with the line it logs once
ready. The NATS and RQ brokers bind ports in ``PORTS``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tests.conftest import ROOT, die_with_parent, unmeasured
from tests.reliability.broker_log import BrokerLog, replay
from tests.support.chain_processes import CHAIN_SETTINGS, CeleryWorker, RedisServer
from tests.support.nats_server import NATS_SERVER, NatsCluster, NatsServer
from tests.support.rabbitmq import RabbitMQNode
from tests.support.servers import free_port_in, free_ports_in

# Where the NATS and RQ brokers listen (never the machine's 4222 or 6379).
PORTS = range(17600, 17700)
# The NATS destination's stream and durable consumer (tests/reliability/chain_nats_settings.py).
NATS_STREAM, NATS_SUBJECTS, NATS_DURABLE = "LEDGER", ["payments.>"], "ledger"
# JetStream delivers a message again once unacknowledged this long, as Redis' visibility
# timeout does for Celery (tests/support/chain_settings.py): a slow ledger task outlasts it.
NATS_ACK_WAIT = 2.0
# RQ's queue of the Tasks framework's default queue name.
RQ_QUEUE = "rq:queue:default"


class Broker(Protocol):
    """A private broker of the chain's own, started again on the same data after a kill."""

    process: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str: ...

    @property
    def log(self) -> Path: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def in_flight(self) -> tuple[int, int]:
        """(messages waiting in the queue, delivered and not yet acknowledged)."""
        ...

    def replay(self) -> BrokerLog:
        """What the broker did with each message, where it keeps a log to replay."""
        ...


class RedisBroker(RedisServer):
    """Its append-only file is never rewritten: ``broker_log.py`` replays it."""

    @classmethod
    def make(cls, directory: Path) -> RedisBroker:
        broker = cls.on_free_port(directory / "redis", ("--auto-aof-rewrite-percentage", "0"))
        broker.directory.mkdir()
        return broker

    @property
    def log(self) -> Path:
        return self.directory / "redis.log"

    def shutdown(self) -> None:
        self.stop()

    def replay(self) -> BrokerLog:
        return replay(self.directory / "appendonlydir")


class RabbitBroker(RabbitMQNode):
    """AMQP keeps a delivered message until its ack (nothing to replay): a worker or a node
    killed gives it back, flagged redelivered."""

    @classmethod
    def make(cls, directory: Path) -> RabbitBroker:
        return cls.on_free_ports(directory / "rabbitmq")

    def replay(self) -> BrokerLog:
        return BrokerLog()


class NatsBroker(NatsServer):
    """Its store survives a kill -9: the stream, its messages, the durable's acknowledgements."""

    @classmethod
    def make(cls, directory: Path) -> NatsBroker:
        broker = cls(free_port_in(PORTS), directory / "nats", preexec_fn=die_with_parent)
        broker.directory.mkdir()
        return broker

    @property
    def log(self) -> Path:
        return self.directory / "nats.log"

    def start(self, timeout: float = 20) -> None:
        super().start(timeout)
        if not (self.directory / "stream-created").exists():
            # Created once; started again, the server finds it in its store.
            self.add_stream(NATS_STREAM, NATS_SUBJECTS)
            (self.directory / "stream-created").touch()

    def shutdown(self) -> None:
        self.stop()

    def in_flight(self) -> tuple[int, int]:
        info = self.consumer_info(NATS_DURABLE, NATS_STREAM)
        return int(info.num_pending), int(info.num_ack_pending)

    def replay(self) -> BrokerLog:
        # A stream keeps what it acknowledged: nothing is dropped after a consumer takes it.
        return BrokerLog()


class NatsClusterBroker(NatsCluster):
    """The cluster of ``tests/support/nats_server.py``, its stream replicated on all three
    nodes. The broker-restart fault kills one node at a time with ``kill -9`` (``process`` is
    the next one's) and starts it again on its store; the other two keep a quorum, so the
    stream keeps taking and delivering messages meanwhile."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, free_ports_in(PORTS, 2 * self.NODES))
        self.next = 0

    @classmethod
    def make(cls, directory: Path) -> NatsClusterBroker:
        return cls(directory / "nats-cluster")

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.nodes[self.next].process

    def start(self, timeout: float = 30) -> None:
        """Start the nodes that are down (at first all three, and the stream); then the
        next fault kills the node after the last one."""
        restarted = super().start(timeout)
        if not (self.directory / "stream-created").exists():
            self.add_stream(NATS_STREAM, NATS_SUBJECTS)
            (self.directory / "stream-created").touch()
        elif restarted < self.NODES:
            self.next = (self.next + 1) % self.NODES

    def in_flight(self) -> tuple[int, int]:
        info = self.consumer_info(NATS_DURABLE, NATS_STREAM)
        return int(info.num_pending), int(info.num_ack_pending)

    def replay(self) -> BrokerLog:
        # Replicated on all three nodes, the stream keeps what it acknowledged.
        return BrokerLog()


class RQBroker(RedisServer):
    """RQ's redis-server. RQ acknowledges nothing: a job taken is off the queue, and one whose
    work horse died is not run again (the relay's redrive hands its message over again, as
    another job), so nothing is ever "delivered and not acknowledged"."""

    @classmethod
    def make(cls, directory: Path) -> RQBroker:
        broker = cls(free_port_in(PORTS), directory / "redis")
        broker.directory.mkdir()
        return broker

    @property
    def log(self) -> Path:
        return self.directory / "redis.log"

    def shutdown(self) -> None:
        self.stop()

    def in_flight(self, queue: str = RQ_QUEUE) -> tuple[int, int]:
        return int(self.client().llen(queue)), 0

    def replay(self) -> BrokerLog:
        return BrokerLog()


def celery_worker(env: dict[str, str], log: Path, concurrency: int) -> subprocess.Popen[bytes]:
    worker = CeleryWorker(
        env, app="tests.reliability.chain_worker", concurrency=concurrency, log=log,
        ready_timeout=None,
    )  # fmt: skip
    return worker.process


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    # In a process group of its own, killed whole (an RQ worker with its work horse).
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, *command], cwd=ROOT, env=unmeasured(env), stdout=out,
            stderr=subprocess.STDOUT, preexec_fn=die_with_parent, start_new_session=True,
        )  # fmt: skip


def nats_consumer(env: dict[str, str], log: Path, concurrency: int) -> subprocess.Popen[bytes]:
    """One ``idempotency_consume_nats`` process (one message at a time: ``concurrency`` is
    the Celery pool's)."""
    return _spawn(
        ["-m", "tests.reliability.chain_nats", "--stream", NATS_STREAM, "--durable",
         NATS_DURABLE, "--handler", "testproject.payments.handlers.post_ledger_entry",
         "--servers", *env["NATS_URL"].split(","), "--ack-wait", str(NATS_ACK_WAIT),
         "--batch", "1"],
        env, log,
    )  # fmt: skip


def rq_worker(env: dict[str, str], log: Path, concurrency: int) -> subprocess.Popen[bytes]:
    """One ``rqworker`` (a work horse forked per job: ``concurrency`` is the Celery pool's)."""
    return _spawn(
        ["manage.py", "rqworker", "--job-class", "tests.reliability.chain_rq.RecordingJob",
         "default"],
        env, log,
    )  # fmt: skip


@dataclass(frozen=True)
class ChainDestination:
    name: str
    # How the report describes the broker and the consumers.
    description: str
    broker: Callable[[Path], Broker]
    # The chain's processes' (and gunicorn's) settings module.
    settings: str
    consumer: Callable[[dict[str, str], Path, int], subprocess.Popen[bytes]]
    # What the consumer logs once it takes messages.
    consumer_ready: str
    # What the broker needs installed (checked before the run).
    requires: str
    # The environment variable the chain's processes find the broker's URL in.
    url_variable: str = "CELERY_BROKER_URL"
    # What the consumer processes are called in the report, and the fault kinds that kill
    # one (with its children) and one of its children (None: it has none).
    consumers: str = "Celery workers"
    consumer_kill: str = "celery-worker-kill"
    child_kill: str | None = "celery-child-kill"
    # Its consumer runs a pool of ChainShape.concurrency children (Celery's prefork).
    pooled: bool = True
    # A module its processes need, and how to install it (None: nothing beyond the test
    # dependencies).
    module: str | None = None
    install: str = ""
    # Its exactly-once consumer stores the ledger task's result, naming the ledger row.
    keeps_results: bool = True

    def missing(self) -> str | None:
        """What the destination needs and this machine lacks: its server, else a module;
        None when nothing is missing."""
        if not (shutil.which(self.requires) or Path(self.requires).exists()):
            return self.requires
        return self.missing_module()

    def missing_module(self) -> str | None:
        """What to install when ``module`` cannot be imported."""
        if self.module is None or importlib.util.find_spec(self.module) is not None:
            return None
        return f"the Python module {self.module} ({self.install})"

    def fault_kinds(self) -> dict[str, str]:
        """The profile's kinds of chain fault (ChainShape.fault_weights) -> how this
        destination's report names them; a kind it has no process for is left out."""
        return (
            {
                kind: kind
                for kind in ("relay-kill", "relay-kill between publish and mark", "broker-restart")
            }
            | {"consumer-kill": self.consumer_kill}
            | ({"consumer-child-kill": self.child_kill} if self.child_kill else {})
        )


NATS_DESTINATION = ChainDestination(
    "nats",
    "NATS JetStream on a private nats-server -js (the ledger message routed to it; ack "
    f"wait {NATS_ACK_WAIT:g} s), consumed by manage.py idempotency_consume_nats",
    NatsBroker.make,
    "tests.reliability.chain_nats_settings",
    nats_consumer,
    " started on stream ",
    NATS_SERVER or "nats-server",
    url_variable="NATS_URL",
    consumers="NATS consumers",
    consumer_kill="nats-consumer-kill",
    child_kill=None,
    pooled=False,
    module="nats",
    install="pip install -e '.[nats]' in the clone",
    keeps_results=False,
)

DESTINATIONS = {
    destination.name: destination
    for destination in (
        ChainDestination(
            "celery-redis",
            "Celery workers (prefork) on a private redis-server (visibility timeout 2 s)",
            RedisBroker.make,
            CHAIN_SETTINGS,
            celery_worker,
            " ready.",
            "redis-server",
        ),
        ChainDestination(
            "celery-rabbitmq",
            "Celery workers (prefork) on a private RabbitMQ node (publisher confirms, late acks)",
            RabbitBroker.make,
            CHAIN_SETTINGS,
            celery_worker,
            " ready.",
            str(Path("/usr/lib/rabbitmq/bin/rabbitmq-server")),
        ),
        NATS_DESTINATION,
        dataclasses.replace(
            NATS_DESTINATION,
            name="nats-cluster",
            description="NATS JetStream on a cluster of three private nats-server -js nodes, "
            "the stream replicated on all three (a broker restart kills one node, the next one "
            f"each time), ack wait {NATS_ACK_WAIT:g} s, consumed by manage.py "
            "idempotency_consume_nats",
            broker=NatsClusterBroker.make,
        ),
        ChainDestination(
            "tasks-rq",
            "Django's Tasks framework through the outbox backend to RQ on a private "
            "redis-server, run by manage.py rqworker (a work horse per job)",
            RQBroker.make,
            "tests.reliability.chain_tasks_settings",
            rq_worker,
            "*** Listening on",
            "redis-server",
            url_variable="RQ_URL",
            consumers="RQ workers",
            consumer_kill="rq-worker-kill",
            child_kill="rq-work-horse-kill",
            pooled=False,
            module="django_tasks_rq",
            # Its rq-scheduler brings a crontab package that shadows django-celery-beat's
            # python-crontab: install it without, as the shared test environment does.
            install="pip install django-tasks-rq, then pip uninstall rq-scheduler crontab",
        ),
    )
}
