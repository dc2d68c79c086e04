"""A chain profile's run: the faulted traffic of ``run.py`` against charges that capture at
the fake processor and post to the ledger through the outbox, with the chain's own faults.

1. setup: a fresh database, migrated, with token users.
2. the chain: the processor, the destination's private broker (a redis-server, a RabbitMQ
   node, a nats-server), relays and its consumers (Celery workers, NATS consumers, RQ
   workers).
3. faulted traffic, per server shape: SDK clients sending charges (some of whose ledger tasks
   kill their consumer's process mid-task or after their commit, or outlast the visibility
   timeout) while gunicorn workers, relays and consumers are killed, the broker and PostgreSQL
   restarted and connections cut; then the HTTP recovery of ``run.py``.
4. the chain's recovery: relays and workers run without faults until the outbox is drained
   and the queue empty.
5. the invariant: the request's (``checks.py``) and the chain's (``chain_checks.py``).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tests.conftest import GunicornServer
from tests.reliability import chain_checks, checks
from tests.reliability.app import serve
from tests.reliability.chain import RELAY, WORKER, Chain, ChainFaults, run_chain
from tests.reliability.chain_destinations import DESTINATIONS
from tests.reliability.chain_relay import DIED
from tests.reliability.faults import Injector
from tests.reliability.postgres import Database
from tests.reliability.profiles import ChainShape
from tests.reliability.report import Check, Report
from tests.reliability.run import Runner
from tests.support.chain_processes import processor_captures, processor_stats, settle_at

# What the chain's logs say, counted for the report.
LOGGED = {
    "deliveries answered from the consumer record (already ran)": "already ran; acknowledged",
    "deliveries given back while another delivery ran": "is running in another delivery",
    "deliveries given back while the store was unavailable": "found the idempotency store",
    "relays killed between publish and mark": DIED,
    "relay leases lost before marking": "lost its lease",
}
# The ledger task's own fault switches, as first_sighting recorded them.
TASK_FAULT_TAGS = {
    "ledger_crash_once:": "task crash: its process killed mid-task",
    "ledger_crash_after_commit_once:": "task crash after commit: its process killed before ack",
}


class ChainRunner(Runner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.profile.chain is not None
        self.shape: ChainShape = self.profile.chain
        self.destination = DESTINATIONS[self.shape.destination]
        self.directory = Path(tempfile.mkdtemp(prefix="idem-chain-"))
        self.chain: Chain | None = None
        self.state: chain_checks.ChainState | None = None
        self.processor: dict[str, int] = {}
        self.restarts: dict[str, int] = {}

    def run(self, database: Database, traffic_seconds: float) -> Report:
        report = super().run(database, traffic_seconds)
        if report.passed:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            # What happened, in order: the chain's logs, its deliveries, the faults.
            offset = time.time() - time.monotonic()
            timeline = [
                {"at": f.at + offset, "kind": f.kind, "detail": f.detail} for f in self.faults
            ]
            (self.directory / "faults.json").write_text(json.dumps(timeline, indent=1))
            self.say(f"The chain's logs, deliveries and faults are kept in {self.directory}")
        return report

    def phases_in_order(self, database: Database, traffic_seconds: float) -> None:
        self.principals = self.token_principals()
        shapes = self.profile.shapes
        with ExitStack() as stack:
            self.chain = stack.enter_context(
                run_chain(database, self.shape, self.directory, self.logs)
            )
            for index, shape in enumerate(shapes):
                with ExitStack() as server_stack:
                    # The chain's processes start while the first server does.
                    first = "the chain and " if index == 0 else ""
                    with self.phase(f"start {first}{shape.describe()}"):
                        server = server_stack.enter_context(serve(
                            database, shape, self.logs, settings=self.destination.settings,
                            env=self.chain.env,
                        ))  # fmt: skip
                        self.chain.wait_ready()
                        if self.shape.settle:
                            self.settle_to(server)
                    with self.phase(f"faulted traffic, {shape.describe()}"):
                        seconds = traffic_seconds / len(shapes)
                        self.faulted_traffic(server, database, shape, seconds)
                    with self.phase(f"recovery, {shape.describe()}"):
                        self.recover(server.url, shape)
            with self.phase("chain recovery: outbox drained, queue empty"):
                self.drain(database, self.chain)
                self.state = chain_checks.collect(
                    database,
                    processor_captures(self.chain.processor_url),
                    self.chain.read_deliveries(),
                    self.chain.broker_log(),
                    settled=self.shape.settle,
                    results=self.destination.keeps_results,
                )
                self.processor = processor_stats(self.chain.processor_url)
                supervisor = self.chain.supervisor
                self.restarts = {kind: supervisor.restarts(kind) for kind in (RELAY, WORKER)}

    def settle_to(self, server: GunicornServer) -> None:
        """Have the processor settle its captures at ``server``'s webhook (deliveries still
        being tried go there too)."""
        assert self.chain is not None
        settle_at(
            self.chain.processor_url,
            f"{server.url}{checks.WEBHOOK_PATH}",
            self.chain.env["PAYMENTS_WEBHOOK_SECRET"],
        )

    def injectors(self, server: GunicornServer, database: Database) -> list[Injector]:
        assert self.chain is not None
        rng = random.Random(self.rng.random())
        faults = ChainFaults(self.chain, self.shape, rng, self.say)
        return [*super().injectors(server, database), faults]

    def drain(self, database: Database, chain: Chain) -> None:
        """Wait until every outbox row is published and consumed, and nothing is queued or
        held by a worker (a message a killed worker held stays in kombu's unacknowledged set
        until Redis gives it back; one the broker dropped waits for the relay's redrive); and,
        where the processor settles, every committed charge is settled."""
        settle, started = 1.0, time.monotonic()
        deadline = started + self.shape.drain_timeout
        quiet_since: float | None = None
        state = (-1, -1, -1, -1)
        while time.monotonic() < deadline:
            try:
                unsettled = self.unsettled(database) if self.shape.settle else 0
                state = (self.backlog(database), *chain.broker.in_flight(), unsettled)
            # The database or the broker still coming back (each broker's client raises its
            # own errors).
            except Exception:
                state = (-1, -1, -1, -1)
            now = time.monotonic()
            if state != (0, 0, 0, 0):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= settle:
                break
            time.sleep(0.25)
        drained = state == (0, 0, 0, 0)
        self.checks.append(Check(
            "after recovery, the outbox is drained and the queue empty",
            drained,
            f"after {time.monotonic() - started:.0f}s: {state[0]} outbox rows unpublished, "
            f"{state[1]} messages queued, {state[2]} delivered and not acknowledged, "
            f"{state[3]} committed charges not settled",
        ))  # fmt: skip

    def backlog(self, database: Database) -> int:
        """Outbox rows not yet published, or published and not yet recorded by their
        exactly-once consumer."""
        with database.connect() as conn:
            row = conn.execute(
                "SELECT count(*) FROM django_idempotency_outbox o WHERE o.published_at IS NULL "
                "OR NOT EXISTS (SELECT FROM django_idempotency_record r "
                "WHERE r.key = o.id::text AND r.method = %s)",
                [checks.TASK_METHOD],
            ).fetchone()
        return int(row[0]) if row else -1

    def unsettled(self, database: Database) -> int:
        """Committed charges the processor's webhook has not settled yet."""
        with database.connect() as conn:
            row = conn.execute(
                "SELECT count(*) FROM payments_charge c WHERE NOT EXISTS "
                "(SELECT FROM payments_settlement s WHERE s.charge_id = c.id)"
            ).fetchone()
        return int(row[0]) if row else -1

    def beyond_the_request(self, database: Database) -> list[checks.Findings]:
        if self.state is None:
            self.checks.append(Check(
                "the chain's stores were read after its recovery", False,
                "the run ended before the chain's recovery",
            ))  # fmt: skip
            return []
        findings = chain_checks.check_chain(self.state)
        found = dict(Counter(v.what for v in findings.violations))
        self.checks.append(Check(
            "every charge: one capture, one outbox row, one ledger row; every outbox row "
            "published and delivered; every task result names its ledger row",
            not findings.violations,
            f"{findings.checked['charges']} committed charges, "
            f"{findings.checked['outbox rows']} outbox rows, "
            f"{findings.checked['task results']} stored task results; "
            f"violations: {found or 'none'}",
        ))  # fmt: skip
        return [findings]

    def count_faults(self, database: Database) -> dict[str, int]:
        counted = super().count_faults(database)
        with database.connect() as conn:
            for prefix, label in TASK_FAULT_TAGS.items():
                row = conn.execute(
                    "SELECT count(*) FROM payments_faulttag WHERE tag LIKE %s", [prefix + "%"]
                ).fetchone()
                counted[label] = int(row[0]) if row else 0
        counted["slow task: outlasted the visibility timeout"] = sum(
            e.kind == "slow task" for e in self.ledger.exchanges
        )
        return counted

    def environment(self, database: Database, traffic_seconds: float) -> dict[str, str]:
        return {
            **super().environment(database, traffic_seconds),
            "servers": "; ".join(s.describe() for s in self.profile.shapes)
            + f" (gunicorn --preload, {self.destination.settings}, PAYMENTS_FAULTS_ENABLED=1)",
            "chain": self.shape.describe(),
        }

    def fill(self, report: Report, findings: Any) -> None:
        super().fill(report, findings)
        if self.chain is not None:
            report.fault_errors += [f"supervisor: {e}" for e in self.chain.supervisor.errors]
        if self.state is None:
            return
        text = "\n".join(self.logs)
        answered = sum(
            e.success is not None for e in self.ledger.exchanges if e.path == "/api/charges/"
        )
        report.chain = {
            "charges answered 2xx (logical requests)": answered,
            **chain_checks.figures(self.state),
            "capture requests at the processor": self.processor.get("requests", 0),
            **(
                {
                    "webhook deliveries sent by the processor": self.processor.get(
                        "webhook_deliveries", 0
                    ),
                    "webhook deliveries answered 2xx": self.processor.get(
                        "webhooks_acknowledged", 0
                    ),
                }
                if self.shape.settle
                else {}
            ),
            "captures answered by the processor as a replay (same downstream key)": (
                self.processor.get("replays", 0)
            ),
            **{label: text.count(needle) for label, needle in LOGGED.items()},
            "relays started again after a kill": self.restarts.get(RELAY, 0),
            f"{self.destination.consumers} started again after a kill": self.restarts.get(
                WORKER, 0
            ),
        }
