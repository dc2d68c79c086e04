"""Where a chain profile's relays publish, and what consumes it: one ``ChainDestination`` per
destination (``python -m tests.reliability --profile chain --destination NAME``).

Each names its broker (a private server the profile starts, kills with ``kill -9`` for the
broker-restart fault and starts again on the same data), the settings of the chain's
processes, and its consumer process (killed whole or one pool child at a time).

Built: Celery on a private ``redis-server`` (the suite's chain-short profile) and Celery on a
private RabbitMQ node. Another destination (NATS JetStream, ``django.tasks`` through RQ) is
one more entry: its broker (``tests/support/nats_server.py``, a private redis-server for
RQ) behind the ``Broker`` protocol, the settings that route ``payments.post_ledger_entry``
to it, and its consumer's command with the line it logs once ready.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tests.reliability.broker_log import BrokerLog, replay
from tests.support.chain_processes import CHAIN_SETTINGS, CeleryWorker, RedisServer
from tests.support.rabbitmq import RabbitMQNode


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


def celery_worker(env: dict[str, str], log: Path, concurrency: int) -> subprocess.Popen[bytes]:
    worker = CeleryWorker(
        env, app="tests.reliability.chain_worker", concurrency=concurrency, log=log,
        ready_timeout=None,
    )  # fmt: skip
    return worker.process


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
    )
}
