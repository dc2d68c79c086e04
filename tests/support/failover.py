"""A failover of the records' database, for ``tests/scenarios/test_failover.py``: a private
primary and its streaming replica (``servers.start_primary``, ``make_standby``), the payments
API under gunicorn, the relay, a Celery worker, a private redis-server and the fake processor
(which settles each capture by its signed webhook to the payments API), all pointed at both
servers through libpq's multi-host form (``target_session_attrs=read-write``), and clients that
send charges and retry each until it is answered, as SDKs do.

``fail_over()`` is what a machine's death and a failover manager do: ``kill -9`` of every
process of the primary, a pause (the manager noticing), ``pg_ctl promote`` of the replica;
``rebuild()`` makes a new replica of the new primary where the dead one was (same port), so
that a longer run fails over again.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import requests

from django_idempotency.messaging.outbox import CHANNEL
from tests.conftest import ROOT, GunicornServer, die_with_parent, run_gunicorn, unmeasured
from tests.support.chain_processes import (
    CHAIN_SETTINGS,
    CeleryWorker,
    RedisServer,
    processor_stats,
    processor_webhooks,
    run_processor,
    settle_at,
    wait_for,
)
from tests.support.payments import CHARGE
from tests.support.servers import (
    PostgresCluster,
    either_url,
    make_standby,
    migrate,
    private_clusters,
    start_primary,
    token_user,
)

DATABASE = "payments"
WEBHOOK_PATH = "/api/webhooks/processor/"
# Charges on the current primary without a settlement, and their capture ids.
UNSETTLED = (
    "SELECT k.capture_id FROM payments_charge c JOIN payments_capture k ON k.charge_id = c.id "
    "WHERE NOT EXISTS (SELECT FROM payments_settlement s WHERE s.charge_id = c.id)"
)
# What a client retries, as SDKs do: the server's refusals that say "again", and the 5xx a
# dying server answers; anything else (a 4xx) is a bug the run reports.
RETRIED = {409, 500, 502, 503, 504}


class Stall:
    """A TCP proxy between the standby and the primary's port that can stop passing the
    primary's bytes on (``hold()``): the standby then receives nothing the primary commits,
    as behind a slow or broken network, which an asynchronous primary does not wait for."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self.flowing.clear()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                downstream, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
                for pump in ((downstream, upstream, False), (upstream, downstream, True)):
                    threading.Thread(target=self._pump, args=pump, daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, holds: bool) -> None:
        with contextlib.suppress(OSError), source, sink:
            while data := source.recv(65536):
                if holds:
                    # Held: nothing more passes, ever (the primary is about to die).
                    self.flowing.wait()
                sink.sendall(data)


@dataclass
class Pair:
    """The primary and its replica; which is which changes at each failover."""

    primary: PostgresCluster
    standby: PostgresCluster
    synchronous: bool
    failovers: int = 0
    # Between the first standby and the primary, when the run makes it lag.
    stall: Stall | None = None
    # Set from the moment the standby lags until it is promoted (``Client.losing``).
    losing: threading.Event = field(default_factory=threading.Event)
    # When the last promotion was done, by the new primary's clock.
    promoted_at: datetime | None = None

    def url(self) -> str:
        return either_url(self.primary, self.standby, DATABASE)

    def fail_over(self, noticed_after: float = 0.5, lag: float = 0.0) -> None:
        """``lag``: for that long before the primary dies, the standby receives nothing
        (through ``stall``) while the primary goes on committing and answering."""
        if lag:
            assert self.stall is not None and not self.synchronous
            self.stall.hold()
            self.losing.set()
            time.sleep(lag)
        self.primary.kill()
        time.sleep(noticed_after)
        self.standby.promote()
        self.losing.clear()
        self.primary, self.standby = self.standby, self.primary
        self.failovers += 1
        with self.primary.connect() as conn:
            row = conn.execute("SELECT now()").fetchone()
        assert row is not None
        self.promoted_at = row[0]

    def rebuild(self) -> None:
        """A new standby of the current primary in the dead server's place (and, synchronous,
        the primary waits for it again)."""
        shutil.rmtree(self.standby.pgdata, ignore_errors=True)
        make_standby(self.primary, self.standby, self.synchronous)

    def listening(self) -> int:
        """Sessions on the primary that LISTEN for the outbox's commits: the relay's."""
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND query = %s"
        return self.count(query, DATABASE, f"LISTEN {CHANNEL}")

    def count(self, query: str, *params: Any) -> int:
        with self.primary.connect(DATABASE) as conn:
            row = conn.execute(query, params).fetchone()
        assert row is not None
        return int(row[0])

    def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with self.primary.connect(DATABASE) as conn:
            return conn.execute(query, params).fetchall()


@dataclass
class Client:
    """One client thread: its charges one after another, each retried with its key until
    it is answered with a 2xx."""

    url: str
    headers: dict[str, str]
    charges: int
    deadline: float
    # While it is set, every other answer is lost on its way (the machine died with the
    # primary, taking the app server's connections with it): the client retries once it is
    # clear, as after any lost answer.
    losing: threading.Event | None = None
    while_losing: int = 0
    answered: dict[str, int] = field(default_factory=dict)
    attempts: Counter[str] = field(default_factory=Counter)
    error: str | None = None

    def run(self) -> None:
        try:
            for _ in range(self.charges):
                key = str(uuid.uuid4())
                self.answered[key] = self.charge(key)
        except Exception as exc:  # reported by the test
            self.error = f"{type(exc).__name__}: {exc}"

    def loses_answer(self) -> bool:
        if self.losing is None or not self.losing.is_set():
            return False
        self.while_losing += 1
        return self.while_losing % 2 == 1

    def charge(self, key: str) -> int:
        while True:
            try:
                response = requests.post(
                    self.url + "/api/charges/",
                    json=CHARGE,
                    headers={**self.headers, "Idempotency-Key": key},
                    timeout=15,
                )
            except requests.RequestException as exc:
                self.attempts[type(exc).__name__] += 1
            else:
                self.attempts[str(response.status_code)] += 1
                if response.status_code < 300 and self.loses_answer():
                    self.attempts["2xx lost on its way"] += 1
                    while self.losing is not None and self.losing.is_set():
                        time.sleep(0.05)
                    continue
                if response.status_code < 300:
                    return response.status_code
                if response.status_code not in RETRIED:
                    raise AssertionError(f"{response.status_code}: {response.text[:300]}")
            if time.monotonic() > self.deadline:
                raise AssertionError(f"key {key} not answered in time")
            time.sleep(0.2)


@dataclass
class Chain:
    pair: Pair
    web: GunicornServer
    worker: CeleryWorker
    relay: subprocess.Popen[bytes]
    processor: str
    headers: dict[str, str]

    def traffic(
        self,
        clients: int,
        charges: int,
        *,
        fail_over_after: list[int],
        timeout: float = 120,
        lag: float = 0.0,
    ) -> list[Client]:
        """``clients`` threads of ``charges`` charges each; a failover once the answered
        charges reach each of ``fail_over_after`` (a rebuilt standby between two), the first
        after the standby lagged ``lag`` seconds."""
        deadline = time.monotonic() + timeout
        losing = self.pair.losing if lag else None
        running = [
            Client(self.web.url, self.headers, charges, deadline, losing) for _ in range(clients)
        ]
        threads = [threading.Thread(target=client.run, daemon=True) for client in running]
        for thread in threads:
            thread.start()
        for n, after in enumerate(fail_over_after):
            reached = partial(answered_at_least, running, after)
            wait_for(reached, timeout=timeout)
            if n:
                self.pair.rebuild()
            self.pair.fail_over(lag=0.0 if n else lag)
        for thread in threads:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))
        return running

    def settled(self, charges: int, timeout: float = 60) -> None:
        """Until every charge has its ledger row (the relay and the worker caught up), and
        every charge without a settlement has no webhook the processor is still sending."""
        wait_for(
            lambda: self.pair.count("SELECT count(*) FROM payments_ledgerentry") >= charges,
            timeout=timeout,
            every=0.2,
        )
        wait_for(lambda: not self.settling(), timeout=timeout, every=0.2)

    def settling(self) -> list[str]:
        """Captures of unsettled charges whose webhook the processor is still sending."""
        webhooks = processor_webhooks(self.processor)
        unsettled = [capture for (capture,) in self.pair.rows(UNSETTLED)]
        return [capture for capture in unsettled if webhooks.get(capture) == "pending"]

    def settlements_lost(self) -> int:
        """Charges on the primary without a settlement though the processor's webhook for
        them was answered 2xx: by a primary whose commit the failover lost."""
        webhooks = processor_webhooks(self.processor)
        unsettled = [capture for (capture,) in self.pair.rows(UNSETTLED)]
        return sum(1 for capture in unsettled if webhooks.get(capture) == "acknowledged")

    def captures(self) -> int:
        return processor_stats(self.processor)["captures"]


def answered_at_least(clients: list[Client], charges: int) -> bool:
    return sum(len(client.answered) for client in clients) >= charges


@contextlib.contextmanager
def chain(
    subprocess_env: Mapping[str, str], directory: Path, *, synchronous: bool, lags: bool = False
) -> Iterator[Chain]:
    """Everything up and pointed at both servers; stopped afterwards. ``lags``: the first
    standby streams through a ``Stall``."""
    with contextlib.ExitStack() as stack:
        primary, standby = stack.enter_context(private_clusters(None, None))
        start_primary(primary)
        pair = Pair(primary, standby, synchronous)
        with primary.connect() as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        broker = RedisServer.on_free_port(directory)
        broker.start()
        stack.callback(broker.stop)
        processor = stack.enter_context(run_processor())
        env = {
            **subprocess_env,
            "DATABASE_URL": pair.url(),
            "CELERY_BROKER_URL": broker.url,
            "PAYMENTS_PROCESSOR_URL": processor,
            # What the processor signs its webhooks with (told below, once the API is up).
            "PAYMENTS_WEBHOOK_SECRET": secrets.token_hex(16),
            "DJANGO_SETTINGS_MODULE": CHAIN_SETTINGS,
        }
        # The standby is copied, and the worker and the servers start, while the database is
        # migrated (neither reads it before its first task or request): half the setup.
        migrating = stack.enter_context(ThreadPoolExecutor(1)).submit(migrate, env)
        if lags:
            pair.stall = Stall(primary.port)
            stack.callback(pair.stall.close)
        make_standby(primary, standby, synchronous, pair.stall.port if pair.stall else None)
        worker = CeleryWorker(env, ready_timeout=None)
        stack.callback(worker.stop)
        web = stack.enter_context(run_gunicorn(env, workers=2, threads=4))
        settle_at(processor, web.url + WEBHOOK_PATH, env["PAYMENTS_WEBHOOK_SECRET"])
        migrating.result()
        token, _ = token_user(primary, DATABASE)
        relay = start_relay(env, directory / "relay.log")
        stack.callback(stop, relay)
        worker.wait_ready(60)
        # The relay listens on the first primary before any traffic, so that a failover
        # test sees it listen again on the next.
        wait_for(pair.listening, timeout=60, every=0.1)
        yield Chain(pair, web, worker, relay, processor, {"Authorization": f"Token {token}"})


def start_relay(env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "manage.py", "idempotency_relay"],
            cwd=ROOT, env=unmeasured(env), stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )  # fmt: skip


def stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait()
