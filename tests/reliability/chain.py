"""The side-effect chain as a chain profile runs it, and the faults made to it from outside.

Beside gunicorn: the fake card processor, the destination's private broker (a redis-server,
a RabbitMQ node, a nats-server: ``chain_destinations.py``), relays and the destination's
consumers (prefork Celery workers, NATS consumers, RQ workers). A supervisor starts a killed
relay or consumer again, as systemd or Kubernetes would. ``ChainFaults`` kills them with
``kill -9`` (a consumer with its children, or one child: a Celery pool child, an RQ work
horse), arms a relay to die between its publish and its mark, and restarts the broker with
``kill -9``; PostgreSQL's restarts are ``ServerFaults``' (faults.py).
"""

from __future__ import annotations

import contextlib
import json
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.conftest import ROOT, die_with_parent, unmeasured
from tests.reliability.app import django_env
from tests.reliability.broker_log import BrokerLog
from tests.reliability.chain_checks import Delivery
from tests.reliability.chain_deliveries import DELIVERIES
from tests.reliability.chain_destinations import DESTINATIONS, Broker, ChainDestination
from tests.reliability.faults import Fault, Injector
from tests.reliability.postgres import Database
from tests.reliability.profiles import ChainShape
from tests.support.chain_processes import kill_group, run_processor, wait_for

BROKER, RELAY, WORKER = "broker", "relay", "consumer"
# Logged by a relay once it can take faults: it has its SIGUSR1 handler by then. A worker is
# ready once it logs its destination's consumer_ready; the broker once it answers, which its
# start waits for.
RELAY_READY = " started on database "


@dataclass
class Slot:
    """One supervised process: started again whenever it exits."""

    kind: str
    log: Path
    start: Callable[[Path], subprocess.Popen[bytes]]
    # What its log says once it can take faults ("": as soon as it runs).
    ready_line: str = ""
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    # Where the current incarnation's part of the log begins.
    offset: int = 0
    # A killed process stays down until then (monotonic time).
    down_until: float = 0.0

    def launch(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.process = self.start(self.log)
        self.starts += 1

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready(self) -> bool:
        if not self.alive():
            return False
        if not self.ready_line:
            return True
        with self.log.open("rb") as log:
            log.seek(self.offset)
            return self.ready_line.encode() in log.read()


class Supervisor(threading.Thread):
    """Keeps every slot's process running until stopped."""

    def __init__(self, slots: list[Slot]) -> None:
        super().__init__(name="Supervisor", daemon=True)
        self.slots = slots
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def run(self) -> None:
        # The processes are started from this thread, which lives as long as they should:
        # die_with_parent ties a child to the thread that started it.
        while True:
            with self.lock:
                for slot in self.slots:
                    if not slot.alive() and time.monotonic() >= slot.down_until:
                        try:
                            slot.launch()
                        except Exception as exc:  # tried again at the next round
                            self.errors.append(f"starting a {slot.kind}: {exc}")
            if self.stopping.wait(0.1):
                return

    def wait_ready(self, timeout: float) -> None:
        wait_for(lambda: all(slot.ready() for slot in self.slots), timeout, every=0.2)

    def ready(self, kind: str) -> list[Slot]:
        return [slot for slot in self.slots if slot.kind == kind and slot.ready()]

    def kill(self, slot: Slot, down: float = 0.0) -> int:
        """``kill -9`` the slot's process and its children; started again after ``down``
        seconds. Returns the pid killed."""
        with self.lock:  # not started again before it is dead
            assert slot.process is not None
            slot.down_until = time.monotonic() + down
            kill_group(slot.process)
            return slot.process.pid

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        for slot in self.slots:
            if slot.process is not None:
                kill_group(slot.process)

    def restarts(self, kind: str) -> int:
        return sum(slot.starts - 1 for slot in self.slots if slot.kind == kind)

    def logs(self) -> list[str]:
        return [slot.log.read_text(errors="replace") for slot in self.slots if slot.log.exists()]


@dataclass
class Chain:
    """The chain's running processes, and what gunicorn needs to use them."""

    env: dict[str, str]
    broker: Broker
    processor_url: str
    supervisor: Supervisor
    deliveries: Path
    logs: list[str] = field(default_factory=list)

    def broker_log(self) -> BrokerLog:
        return self.broker.replay()

    def wait_ready(self) -> None:
        self.supervisor.wait_ready(timeout=120)

    def read_deliveries(self) -> list[Delivery]:
        found = []
        for path in sorted(self.deliveries.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                # A worker killed while writing leaves a partial last line.
                with contextlib.suppress(ValueError, KeyError):
                    data = json.loads(line)
                    found.append(Delivery(data["id"], data["tag"], data["redelivered"]))
        return found


@contextlib.contextmanager
def run_chain(
    database: Database, shape: ChainShape, directory: Path, logs: list[str]
) -> Iterator[Chain]:
    """Start the processor, then the broker, the relays and the workers in the background
    (``Chain.wait_ready``); stop them at the end and append their logs to ``logs``."""
    destination = DESTINATIONS[shape.destination]
    # Started, and started again after each kill, by the supervisor.
    broker = destination.broker(directory)
    deliveries = directory / "deliveries"
    deliveries.mkdir()
    try:
        with run_processor() as processor_url:
            env = {
                **django_env(database, settings=destination.settings),
                destination.url_variable: broker.url,
                "PAYMENTS_PROCESSOR_URL": processor_url,
                # What the processor signs its webhooks with (chain_run.py tells it).
                "PAYMENTS_WEBHOOK_SECRET": secrets.token_hex(16),
                DELIVERIES: str(deliveries),
            }
            slots = (
                [Slot(BROKER, broker.log, lambda _: _broker(broker))]
                + [
                    Slot(RELAY, directory / f"relay-{n}.log", lambda log: _relay(env, log),
                         RELAY_READY)
                    for n in range(shape.relays)
                ]
                + [
                    Slot(WORKER, directory / f"worker-{n}.log",
                         lambda log: _worker(destination, env, log, shape),
                         destination.consumer_ready)
                    for n in range(shape.workers)
                ]
            )  # fmt: skip
            supervisor = Supervisor(slots)
            supervisor.start()
            try:
                yield Chain(env, broker, processor_url, supervisor, deliveries)
            finally:
                supervisor.stop()
                logs += supervisor.logs()
    finally:
        broker.shutdown()


def _broker(broker: Broker) -> subprocess.Popen[bytes]:
    broker.start()
    assert broker.process is not None
    return broker.process


def _relay(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    # Not traced by coverage.py: a chain relay ends with kill -9 and saves nothing.
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.chain_relay"],
            cwd=ROOT, env=unmeasured(env), stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent, start_new_session=True,
        )  # fmt: skip


def _worker(
    destination: ChainDestination, env: dict[str, str], log: Path, shape: ChainShape
) -> subprocess.Popen[bytes]:
    return destination.consumer(env, log, shape.concurrency)


# The process each kind of chain fault (ChainShape.fault_weights) is made to.
KINDS = {
    "relay-kill": RELAY,
    "relay-kill between publish and mark": RELAY,
    "consumer-kill": WORKER,
    "consumer-child-kill": WORKER,
    "broker-restart": BROKER,
}


class ChainFaults(Injector):
    """kill -9 a relay (at any moment, or armed to die between publish and mark), a consumer
    with its children or one child; restart the broker with kill -9. Each fault is named as
    the destination names it (``ChainDestination.fault_kinds``)."""

    def __init__(
        self, chain: Chain, shape: ChainShape, rng: random.Random, say: Callable[[str], None]
    ) -> None:
        super().__init__(shape.fault_every, rng, say)
        self.chain = chain
        self.shape = shape
        named = DESTINATIONS[shape.destination].fault_kinds()
        self.kinds = {label: kind for kind, label in named.items()}
        self.weights = {
            named[kind]: weight for kind, weight in shape.fault_weights.items() if kind in named
        }
        # Relays armed to die between publish and mark: a relay kill spares them while it
        # can, or the death the arming is for would never come.
        self.armed: set[int] = set()

    def inject(self, started: float) -> Fault:
        kind = self.choose(self.weights)
        made = self.kinds[kind]
        supervisor = self.chain.supervisor
        if made == "consumer-child-kill":
            return self._kill_a_child(kind, started)
        ready = supervisor.ready(KINDS[made])
        if not ready:
            return Fault(f"{kind} skipped", started, "none ready")
        if made == "relay-kill between publish and mark":
            # Every running relay: whichever takes the next rows dies after publishing them.
            # One armed alone could wait out a short run while the other took every batch.
            pids = [s.process.pid for s in ready if s.process is not None]
            for relay in ready:
                assert relay.process is not None
                relay.process.send_signal(signal.SIGUSR1)
            self.armed.update(pids)
            return Fault(kind, started, f"armed relays {', '.join(map(str, pids))}")
        if KINDS[made] == RELAY:
            unarmed = [s for s in ready if s.process and s.process.pid not in self.armed]
            if not unarmed and len(ready) < 2:
                # The last armed relay standing (the other restarting): killed now, the death
                # the arming is for could miss a short run on a slow machine.
                return Fault(f"{kind} skipped", started, "the one relay up is armed")
            ready = unarmed or ready
        victim = self.rng.choice(ready)
        assert victim.process is not None
        if made == "broker-restart":
            down = self.rng.uniform(*self.shape.broker_down_seconds)
            supervisor.kill(victim, down)
            wait_for(lambda: victim.ready(), timeout=30, every=0.05)
            took = time.monotonic() - started
            return Fault(kind, started, f"SIGKILL the broker, back after {took:.1f}s")
        pid = supervisor.kill(victim)
        return Fault(kind, started, f"SIGKILL {victim.kind} {pid} and its children")

    def _kill_a_child(self, kind: str, started: float) -> Fault:
        """SIGKILL one pool child of a running consumer, waiting (up to 20 s) for one: right
        after the consumers were killed, none may have its pool up yet on a busy machine."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for victim in self.chain.supervisor.ready(WORKER):
                if victim.process is None:
                    continue
                with contextlib.suppress(psutil.Error):
                    children = psutil.Process(victim.process.pid).children()
                    if children:
                        child = self.rng.choice(children)
                        child.send_signal(signal.SIGKILL)
                        return Fault(kind, started, f"SIGKILL child {child.pid}")
            time.sleep(0.1)
        return Fault(f"{kind} skipped", started, "no consumer with a pool child")
