"""Fault injectors that run beside the traffic: worker kills, database outages, connection
cuts, and partition maintenance with its DDL."""

from __future__ import annotations

import importlib.util
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from django_idempotency.partitions.catalog import DROPPING_COMMENT, PARTITION_COMMENT
from django_idempotency.partitions.tables import RECORDS
from tests.conftest import GunicornServer
from tests.reliability.app import manage, workers
from tests.reliability.postgres import Database
from tests.reliability.profiles import Profile

TABLE = RECORDS.table


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float
    detail: str
    ok: bool = True
    # A finer kind ("restart -m immediate"), and a count of what it touched ("backends
    # terminated": 3) for the report.
    variant: str = ""
    unit: str = ""
    units: int = 0


def maintenance_available() -> bool:
    return (
        importlib.util.find_spec("django_idempotency.management.commands.idempotency_partitions")
        is not None
    )


class Injector(threading.Thread):
    """Base: call ``inject()`` every ``every`` seconds (uniform) until stopped."""

    def __init__(
        self, every: tuple[float, float], rng: random.Random, say: Callable[[str], None]
    ) -> None:
        super().__init__(name=type(self).__name__, daemon=True)
        self.every = every
        self.rng = rng
        self.say = say
        self.stopping = threading.Event()
        self.faults: list[Fault] = []

    def run(self) -> None:
        while not self.stopping.wait(self.rng.uniform(*self.every)):
            started = time.monotonic()
            try:
                self.faults.append(self.inject(started))
            except Exception as exc:  # recorded, never fatal: the run goes on
                self.say(f"  ! {self.name}: {type(exc).__name__}: {exc}")
                detail = f"{type(exc).__name__}: {str(exc)[:500]}"
                self.faults.append(Fault(f"{self.name} error", started, detail, False))

    def inject(self, started: float) -> Fault:
        raise NotImplementedError

    def choose(self, weights: dict[str, int]) -> str:
        """Every kind once first, so that even a short run sees them all; then by weight."""
        untried = [k for k in weights if k not in {f.kind for f in self.faults}]
        if untried:
            return self.rng.choice(untried)
        return self.rng.choices(list(weights), weights=list(weights.values()))[0]

    def halt(self) -> None:
        """No new fault from now on (one under way finishes)."""
        self.stopping.set()

    def stop(self) -> list[Fault]:
        self.halt()
        self.join()
        return self.faults


class ServerFaults(Injector):
    """kill -9 a gunicorn worker, take the database away for a moment, or cut the app's
    connections."""

    def __init__(
        self,
        server: GunicornServer,
        database: Database,
        profile: Profile,
        rng: random.Random,
        say: Callable[[str], None],
    ) -> None:
        super().__init__(profile.fault_every, rng, say)
        self.server = server
        self.database = database
        self.weights = profile.fault_weights
        self.outage_modes = profile.outage_modes
        self.outage_seconds = profile.outage_seconds

    def inject(self, started: float) -> Fault:
        kind = self.choose(self.weights)
        if kind == "worker-kill":
            victims = workers(self.server)
            if not victims:
                return Fault("worker-kill skipped", started, "no worker alive to kill")
            victim = self.rng.choice(victims)
            victim.send_signal(signal.SIGKILL)
            return Fault(kind, started, f"SIGKILL worker {victim.pid}")
        if kind == "db-outage":
            mode = self.rng.choice(self.outage_modes)
            pause = self.rng.uniform(*self.outage_seconds)
            with self.database.outage(mode):
                time.sleep(pause)
            what = f"restart -m {mode}" if self.database.private else "refused connections"
            down = time.monotonic() - started
            return Fault(kind, started, f"{what}, unreachable {down:.1f}s", variant=what)
        if kind == "connection-cut":
            cut = self.database.terminate_app_backends()
            return Fault(kind, started, f"terminated {cut} app backends",
                         unit="app backends terminated", units=cut)  # fmt: skip
        raise ValueError(kind)


# How long a maintenance run that found the database down is tried again.
MAINTENANCE_RETRY_SECONDS = 15.0


class Maintenance(Injector):
    """``manage.py idempotency_partitions`` again and again while duplicates arrive. Before
    each run the farthest future partition is dropped so that the run has DDL to do."""

    def __init__(
        self, database: Database, profile: Profile, rng: random.Random, say: Callable[[str], None]
    ) -> None:
        every = profile.maintenance_every
        super().__init__((every * 0.5, every * 1.5), rng, say)
        self.database = database

    def inject(self, started: float) -> Fault:
        # A database outage or a connection cut injected at the same moment fails a run; an
        # operator's cron runs it again, and so do we, until the database is back.
        attempts = 1
        while True:
            try:
                dropped = self._drop_farthest_partition()
                output = manage(self.database, "idempotency_partitions")
                break
            except (psycopg.OperationalError, RuntimeError):
                if time.monotonic() - started > MAINTENANCE_RETRY_SECONDS:
                    raise
                attempts += 1
                time.sleep(0.5)
        created = output.count(f"created {TABLE}_p")
        detail = f"dropped {dropped or 'none'}, created {created}, attempts {attempts}"
        return Fault("maintenance", started, detail, unit="partitions created", units=created)

    def _drop_farthest_partition(self) -> str | None:
        """Drop our farthest partition the way maintenance itself drops one (marked, then
        detached concurrently, so live claims are never queued behind it), so that the
        next maintenance run has one to create. A drop cut short is finished by that run."""
        with self.database.connect() as conn:
            self._finish_cut_short_drops(conn)
            row = conn.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = %s::regclass AND NOT i.inhdetachpending "
                "AND obj_description(c.oid, 'pg_class') = %s "
                # Two days ahead at least: traffic never needs it during the run.
                "AND c.relname > %s || to_char(now() AT TIME ZONE 'UTC' + interval '2 days', "
                "'YYYYMMDD') ORDER BY c.relname DESC LIMIT 1",
                [TABLE, PARTITION_COMMENT, f"{TABLE}_p"],
            ).fetchone()
            if row is None:
                return None
            name = sql.Identifier(row[0])
            conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(
                name, sql.Literal(DROPPING_COMMENT)))  # fmt: skip
            conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(
                sql.Identifier(TABLE), name))  # fmt: skip
            conn.execute(sql.SQL("DROP TABLE {}").format(name))
        return str(row[0])

    def _finish_cut_short_drops(self, conn: Any) -> None:
        # A drop of ours cut short by a database outage leaves a partition pending detach,
        # or a detached table, marked as dropping; left there, it blocks creating the
        # partition of its day again.
        pending = conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass AND i.inhdetachpending "
            "AND obj_description(c.oid, 'pg_class') = %s",
            [TABLE, DROPPING_COMMENT],
        ).fetchall()
        for (name,) in pending:
            conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {} FINALIZE").format(
                sql.Identifier(TABLE), sql.Identifier(name)))  # fmt: skip
        detached = conn.execute(
            "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r' AND c.relname LIKE %s "
            "AND obj_description(c.oid, 'pg_class') = %s "
            "AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)",
            [f"{TABLE}_p%", DROPPING_COMMENT],
        ).fetchall()
        for (name,) in detached:
            conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))
