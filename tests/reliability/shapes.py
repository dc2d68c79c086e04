"""The deployment shapes of issue 22, each made once per run: configurations that real
deployments have, under which one key must still execute at most once and no principal may
be shown another's response. The library may instead refuse a request that it cannot keep
the promise for (``500`` problem type ``misconfigured``): a refusal executes nothing.

- repeatable read database: a copy of the run's database whose sessions default to
  REPEATABLE READ (``ALTER DATABASE … SET default_transaction_isolation``), served by a
  gunicorn of its own with waiting switched on; a slow charge, and duplicates that wait on
  its lock. A duplicate that takes the lock once the first has committed must see its
  record, or the claim must refuse the level.
- two app servers, two SECRET_KEYs: a second gunicorn on the run's database with a
  ``SECRET_KEY`` of its own (a rolling rotation, per-pod secrets); a slow charge to the run's
  server and, while it runs, the same key to the second.
- @idempotent above authentication: the suite's own view (``views.py``, served by the
  shapes' URLconf only) written as the docs' plain view with the decorators swapped. Alice
  sends a charge; then Bob, with his token, and a client with no credentials send the same
  key and body. Neither may be answered Alice's response.

Every exchange goes in the run's ledger (the repeatable-read one marked with the copy's
name), so the run's invariant covers them: a duplicate is a logical request with more than
one row, a leak a principal answered another's response. The shapes' two servers start
during the run's cold start; the repeatable-read shape, on its own database, runs beside
the other two.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from types import TracebackType
from typing import Any

from tests.conftest import GunicornServer
from tests.reliability.app import serve
from tests.reliability.attacks import Phase, executions, wait_for_handler
from tests.reliability.client import (
    EFFECT_OR_REFUSAL,
    MISCONFIGURED,
    Attempt,
    Exchange,
    Principal,
)
from tests.reliability.postgres import Database, copy_of
from tests.reliability.profiles import MISORDERED_PATH, SHAPE_KINDS, ServerShape
from tests.reliability.report import Check

REPEATABLE_READ, TWO_SECRETS, MISORDERED = SHAPE_KINDS
SHAPES_SETTINGS = "tests.reliability.shapes_settings"
# The repeatable-read database's server: duplicates wait (opt-in), and a thread per process
# stays free of them.
WAITING_SERVER = ServerShape(workers=2, threads=4)
WAIT_SECONDS = 10
MAX_WAITERS = 3
SECOND_SERVER = ServerShape(workers=2)
# Read by the long profile's duplicates: they wait behind several executions of the charge.
READ_TIMEOUT = 60.0


class Shapes(Phase):
    """Make the copy (``prepare``, before anything connects to the run's database), start
    the servers in the background (``start``), make the shapes (``run``); the servers stop
    when the block of ``with shapes:`` ends, the copy when ``beside`` closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copy: Database | None = None
        self.servers: dict[str, Future[GunicornServer]] = {}
        self.stack = ExitStack()
        self.starting = ThreadPoolExecutor(2, thread_name_prefix="shape-server")

    def __enter__(self) -> Shapes:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # A server still starting is entered, then stopped.
        self.starting.shutdown(wait=True)
        self.stack.close()

    def prepare(self, beside: ExitStack) -> Database:
        """The repeatable-read copy of the run's database, dropped when ``beside`` closes."""
        self.copy = beside.enter_context(
            copy_of(self.database, "rr", {"default_transaction_isolation": "repeatable read"})
        )
        return self.copy

    def start(self) -> None:
        """Start both servers in the background."""
        assert self.copy is not None
        waiting = {
            "RELIABILITY_WAIT_SECONDS": str(WAIT_SECONDS),
            "RELIABILITY_MAX_WAITERS": str(MAX_WAITERS),
        }
        secret = {"DJANGO_SECRET_KEY": secrets.token_urlsafe(40)}
        for name, database, shape, env in (
            (REPEATABLE_READ, self.copy, WAITING_SERVER, waiting),
            (TWO_SECRETS, self.database, SECOND_SERVER, secret),
        ):
            context = serve(database, shape, self.logs, settings=SHAPES_SETTINGS, env=env)
            self.servers[name] = self.starting.submit(self.stack.enter_context, context)

    def run(self, base_url: str, alice: Principal, bob: Principal) -> list[Check]:
        """Make the three shapes; ``base_url`` is the run's server (testproject.settings)."""
        isolated = self.servers[REPEATABLE_READ].result().url
        second = self.servers[TWO_SECRETS].result().url
        with ThreadPoolExecutor(1) as aside:
            # On a database and a server of its own: beside the other two.
            repeatable_read = aside.submit(
                self.timed, REPEATABLE_READ, self.repeatable_read, isolated, alice
            )
            self.timed(TWO_SECRETS, self.two_secrets, base_url, second, alice)
            self.timed(MISORDERED, self.misordered, second, alice, bob)
            repeatable_read.result()
        return self.checks

    # -- the shapes -----------------------------------------------------------------------

    def repeatable_read(self, url: str, alice: Principal) -> None:
        """A slow charge and ``shape_duplicates`` duplicates waiting on its lock, on the
        copy whose sessions default to REPEATABLE READ."""
        assert self.copy is not None
        with self.copy.connect() as conn:
            row = conn.execute("SHOW default_transaction_isolation").fetchone()
        level = row[0] if row else "?"
        delay, count = self.profile.shape_delay_ms, self.profile.shape_duplicates
        exchange = self.ledger.new(
            alice, kind=REPEATABLE_READ, expect=EFFECT_OR_REFUSAL, delay_ms=delay
        )
        exchange.database = self.copy.name
        before = executions(url)
        with ThreadPoolExecutor(1 + count) as pool:
            holder = pool.submit(self.client(url, READ_TIMEOUT).send, exchange)
            wait_for_handler(url, before, holder)
            duplicates = [
                pool.submit(self.client(url, READ_TIMEOUT).send, exchange) for _ in range(count)
            ]
            for future in (holder, *duplicates):
                future.result()
        self.made[REPEATABLE_READ] += 1 + count
        rows, records = self.effects(self.copy, exchange)
        self.checks.append(Check(
            f"{REPEATABLE_READ}: one key executes once, or is refused (misconfigured)",
            _once_or_refused(exchange, rows, records),
            f"the copy's sessions start at {level!r} (ALTER DATABASE ... SET "
            f"default_transaction_isolation); a {delay} ms charge and {count} duplicates "
            f"waiting on its lock (IDEMPOTENCY_WAIT={WAIT_SECONDS}s, "
            f"{WAITING_SERVER.describe()}): {rows} charges and {records} records "
            f"committed; answers {_answers(exchange.attempts)}",
        ))  # fmt: skip

    def two_secrets(self, base_url: str, second: str, alice: Principal) -> None:
        """A slow charge to the run's server (one attempt) and, while it runs, the same key
        to the second server, whose SECRET_KEY differs, sent there until answered."""
        delay = self.profile.shape_delay_ms
        exchange = self.ledger.new(alice, kind=TWO_SECRETS, delay_ms=delay)
        before = executions(base_url)
        with ThreadPoolExecutor(1) as holding:
            holder = holding.submit(self.client(base_url, READ_TIMEOUT).attempt, exchange)
            wait_for_handler(base_url, before, holder)
            sent = time.monotonic()
            self.client(second, READ_TIMEOUT).send(exchange)
            holder.result()
        # The holder's one attempt started before: the rest went to the second server.
        duplicate = [a for a in exchange.attempts if a.started >= sent]
        self.made[TWO_SECRETS] += 2
        rows, records = self.effects(self.database, exchange)
        final = duplicate[-1] if duplicate else None
        self.checks.append(Check(
            f"{TWO_SECRETS}: one key executes once across both",
            rows == 1 and records == 1 and len(_bodies(exchange)) == 1
            and final is not None and final.ok and final.replayed,
            f"a {delay} ms charge to the run's server (the testproject's SECRET_KEY) and, "
            f"while it ran, the same key to a second server on the same database with "
            f"another SECRET_KEY ({SECOND_SERVER.describe()}), answered there "
            f"{_answers(duplicate)}; {rows} charges and {records} records committed, "
            f"{len(_bodies(exchange))} distinct 2xx answers",
        ))  # fmt: skip

    def misordered(self, url: str, alice: Principal, bob: Principal) -> None:
        """Alice's charge to the misordered view, then Bob and a client with no credentials
        with her key and body."""
        client = self.client(url)
        first = self.ledger.new(alice, MISORDERED_PATH, kind=MISORDERED, expect=EFFECT_OR_REFUSAL)
        client.send(first)
        strangers = [
            self.ledger.add(
                Exchange(p, MISORDERED_PATH, first.key, first.body, MISORDERED, EFFECT_OR_REFUSAL)
            )
            for p in (bob, Principal("anonymous", "anonymous", {}))
        ]
        for stranger in strangers:
            client.send(stranger)
        client.close()
        self.made[MISORDERED] += 1 + len(strangers)
        own = first.success is None or _user(first.success) == alice.username
        shown = [
            s for s in strangers
            if s.success is not None and _user(s.success) != s.principal.username
        ]  # fmt: skip
        ended = [e for e in (first, *strangers) if e.success or (e.final and e.final.refusal)]
        self.checks.append(Check(
            f"{MISORDERED}: no principal is answered another's response",
            own and not shown and len(ended) == 3,
            f"{MISORDERED_PATH} (the docs' plain view with @idempotent above its token "
            f"check): Alice {_answers(first.attempts)}; with her key and body, Bob (token) "
            f"{_answers(strangers[0].attempts)}, no credentials "
            f"{_answers(strangers[1].attempts)}"
            + "".join(
                f"; {s.principal.username} was answered {_user(s.success)}'s response"
                for s in shown if s.success
            ),
        ))  # fmt: skip

    # -- helpers --------------------------------------------------------------------------

    def effects(self, database: Database, exchange: Exchange) -> tuple[int, int]:
        """Committed charges of the exchange's amount, and records of its key."""
        with database.connect() as conn:
            rows = conn.execute(
                "SELECT count(*) FROM payments_charge WHERE amount = %s", [exchange.amount]
            ).fetchone()
            records = conn.execute(
                "SELECT count(*) FROM django_idempotency_record WHERE key = %s", [exchange.key]
            ).fetchone()
        return (int(rows[0]) if rows else -1), (int(records[0]) if records else -1)


def _once_or_refused(exchange: Exchange, rows: int, records: int) -> bool:
    """One execution answered alike to every send, or every send refused as misconfigured."""
    attempts = exchange.attempts
    if rows == 1 and records == 1:
        return len(_bodies(exchange)) == 1 and not any(a.problem == MISCONFIGURED for a in attempts)
    return (
        (rows, records) == (0, 0)
        and bool(attempts)
        and all(a.problem == MISCONFIGURED for a in attempts)
    )


def _bodies(exchange: Exchange) -> set[bytes]:
    return {a.body for a in exchange.attempts if a.ok}


def _user(attempt: Attempt) -> object:
    try:
        body = json.loads(attempt.body)
    except ValueError:
        return None
    return body.get("user") if isinstance(body, dict) else None


def _answers(attempts: list[Attempt]) -> str:
    counted = Counter(
        a.outcome + (" replayed" if a.replayed else "") + (f" {a.problem}" if a.problem else "")
        for a in attempts
    )
    return ", ".join(f"{k} x{v}" for k, v in sorted(counted.items())) or "nothing"
