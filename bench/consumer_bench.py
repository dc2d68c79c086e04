"""Exactly-once consumers: what ``ExactlyOnceTask`` adds to a task, against the same plain task.

Both tasks run one business ``INSERT`` and commit it; the plain one in its own
``transaction.atomic()``, the exactly-once one in the unit of work (claim, body, stored JSON
result, commit). Each call is ``task.apply(task_id=...)``: Celery's tracer, as a worker runs a
task, without a broker, whose cost is the same for both and would only add noise. The calls
alternate (plain, exactly-once, in an order reversed every other round) so that drift in the
machine's load hits both alike; the overhead is the difference of the medians. A third cell
times a redelivery of an already committed message (the replay).

Each round also sends the exactly-once task's own statements from a bare psycopg connection
(no Django, no Celery, no library code): the claim, and the store with its COMMIT against a
plain COMMIT of the same business row. Their sum is the overhead's floor, what the database
and the network take however little the client does; the rest of the overhead is the
client's Python (the library, Django's cursors, psycopg).

``python -m bench consumer``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from bench.report import Check, Section, median, percentile
from bench.server import ROOT, django_env

if TYPE_CHECKING:
    from bench.run import Options

TABLE = "consumer_bench_business"
# The bare connection's business rows, apart, so that the count of the tasks' rows still
# proves that no task ran twice.
FLOOR_TABLE = "consumer_bench_floor"
FLOOR_TASK = "bench.consumer.floor"


def setup_django(url: str) -> None:
    os.environ.update(django_env(url))
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def make_tasks() -> tuple[Any, Any]:
    from celery import Celery
    from django.db import connection, transaction

    from django_idempotency.messaging.consumers.celery import ExactlyOnceTask

    app = Celery("consumer-bench", set_as_current=False)
    app.conf.update(broker_url="memory://", task_ignore_result=True)
    insert = f"INSERT INTO {TABLE} (n, amount) VALUES (%s, %s)"

    @app.task(name="bench.consumer.plain", bind=True, shared=False)
    def plain(self: Any, n: int, amount: int) -> dict[str, int]:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(insert, [n, amount])
        return {"n": n}

    @app.task(name="bench.consumer.once", base=ExactlyOnceTask, bind=True, shared=False)
    def once(self: Any, n: int, amount: int) -> dict[str, int]:
        with connection.cursor() as cursor:
            cursor.execute(insert, [n, amount])
        return {"n": n}

    app.finalize()
    return plain, once


class Floor:
    """The exactly-once task's statements, sent from a bare psycopg connection with the
    parameters the library sends: what they cost with no client code around them."""

    def __init__(self, url: str) -> None:
        import psycopg

        from django_idempotency.conf import conf
        from django_idempotency.engine.hashing import lock_id
        from django_idempotency.messaging.consumers.exactly_once import (
            JSON_HEADERS,
            METHOD,
            PRINCIPAL_PREFIX,
        )
        from django_idempotency.storage import records

        self.conn = psycopg.connect(url)
        self.cursor = psycopg.ClientCursor(self.conn)
        self.lock_id = lock_id
        self.principal = PRINCIPAL_PREFIX + FLOOR_TASK
        self.claim_sql = records._CLAIM
        self.store_sql = records._STORE + "; COMMIT"
        self.window = max(conf.MAX_TTL, conf.CONSUMER_TTL) + conf.EXPIRED_WINDOW
        self.gone = conf.EXPIRED_WINDOW
        self.wait_ms = int(conf.CONSUMER_WAIT.total_seconds() * 1000)
        self.ttl = conf.CONSUMER_TTL
        self.method = METHOD
        self.headers = json.dumps(JSON_HEADERS)
        self.insert = f"INSERT INTO {FLOOR_TABLE} (n, amount) VALUES (%s, %s)"

    def _timed(self, sql: str, params: list[Any] | None = None) -> tuple[float, Any]:
        started = time.perf_counter()
        self.cursor.execute(sql, params)
        elapsed = time.perf_counter() - started
        return elapsed, self.cursor.fetchone() if self.cursor.description else None

    def round(self, n: int) -> dict[str, float]:
        """One plain transaction and one exactly-once transaction; their statements' times."""
        cursor = self.cursor
        cursor.execute("SELECT 1")  # psycopg's BEGIN, as both tasks pay it
        trip, _ = self._timed("SELECT 1")
        cursor.execute(self.insert, [n, 2499])
        commit, _ = self._timed("COMMIT")
        key = str(uuid.uuid4())
        cursor.execute("SELECT 1")
        lock = self.lock_id("default", self.principal, key)
        params = [lock, self.principal, key, self.window, self.gone, self.wait_ms, None]
        claim, row = self._timed(self.claim_sql, params)
        if row[0] != "won":
            raise RuntimeError(f"the bare claim of a fresh key found {row[0]!r}")
        cursor.execute(self.insert, [n, 2499])
        created_at = row[1]
        store, _ = self._timed(
            self.store_sql,
            [
                self.principal,
                key,
                self.method,
                FLOOR_TASK,
                json.dumps({"arguments": "0" * 64}),
                created_at,
                created_at + self.ttl,
                200,
                self.headers,
                b'{"n":%d}' % n,
                "",
            ],
        )
        return {"trip": trip, "commit": commit, "claim": claim, "store+commit": store}

    def close(self) -> None:
        self.conn.close()


def timed(task: Any, n: int, task_id: str) -> tuple[float, float]:
    """The call's elapsed time and this thread's CPU time in it."""
    cpu = time.thread_time()
    started = time.perf_counter()
    result = task.apply((n, 2499), task_id=task_id)
    elapsed = time.perf_counter() - started
    cpu = time.thread_time() - cpu
    if result.state != "SUCCESS":
        raise RuntimeError(f"{task.name} ended {result.state}: {result.result!r}")
    return elapsed, cpu


def run(options: Options) -> Section:
    quick = options.requests <= 100
    rounds = 500 if quick else 3000
    warmup = 50 if quick else 200
    setup_django(options.database_url)
    from django.db import connection

    from django_idempotency.models import IdempotencyRecord

    with connection.cursor() as cursor:
        for name in (TABLE, FLOOR_TABLE):
            cursor.execute(f"DROP TABLE IF EXISTS {name}")
            cursor.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, n int, amount int)")
    plain, once = make_tasks()
    floor = Floor(options.database_url)
    cells: dict[str, list[float]] = {"plain": [], "exactly-once": [], "redelivery": []}
    statements: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {"plain": [], "exactly-once": []}
    committed: list[str] = []
    errors: list[str] = []
    for n in range(warmup + rounds):
        order = [("plain", plain), ("exactly-once", once)]
        if n % 2:
            order.reverse()
        for name, task in order:
            message_id = str(uuid.uuid4())
            seconds, used = timed(task, n, message_id)
            if n >= warmup:
                cells[name].append(seconds)
                cpu[name].append(used)
                if task is once:
                    committed.append(message_id)
        if n >= warmup and committed:
            cells["redelivery"].append(timed(once, n, committed[-1])[0])
        bare = floor.round(n)
        if n >= warmup:
            for name, seconds in bare.items():
                statements.setdefault(name, []).append(seconds)
    floor.close()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {TABLE}")
        (rows,) = cursor.fetchone() or (0,)
        cursor.execute(f"DROP TABLE {TABLE}")
        cursor.execute(f"DROP TABLE {FLOOR_TABLE}")
    if rows != 2 * (warmup + rounds):
        errors.append(f"{rows} business rows, not {2 * (warmup + rounds)}: a task ran twice")
    IdempotencyRecord.objects.filter(
        scope__in=["consumer:bench.consumer.once", floor.principal]
    ).delete()
    ms = 1000.0
    medians = {name: median(values) * ms for name, values in cells.items()}
    added = medians["exactly-once"] - medians["plain"]
    header = ["task", "median ms", "p99 ms"]
    rows_out = [
        [name, f"{medians[name]:.3f}", f"{percentile(values, 99) * ms:.3f}"]
        for name, values in cells.items()
    ]
    rows_out.append(["added by ExactlyOnceTask (median)", f"{added:.3f}", ""])
    bare = {name: median(values) * ms for name, values in statements.items()}
    # Thread time counts the client's Python and its system calls, not its waits.
    added_cpu = (median(cpu["exactly-once"]) - median(cpu["plain"])) * ms
    # The claim is a whole round trip more; the store only adds its execution to the
    # COMMIT it travels with.
    sql_floor = bare["claim"] + bare["store+commit"] - bare["commit"]
    rest = added - sql_floor
    floor_rows = [
        ["a round trip (SELECT 1)", f"{bare['trip']:.3f}"],
        ["the claim", f"{bare['claim']:.3f}"],
        ["the store with its COMMIT", f"{bare['store+commit']:.3f}"],
        ["a plain COMMIT of the same row", f"{bare['commit']:.3f}"],
        ["floor: claim + store with COMMIT - COMMIT", f"{sql_floor:.3f}"],
        ["the rest of the overhead", f"{rest:.3f}"],
        ["  of which the client's CPU (thread time, exactly-once - plain)", f"{added_cpu:.3f}"],
        ["  of which waiting for a CPU (the machine's load)", f"{rest - added_cpu:.3f}"],
    ]
    checks = [
        Check(
            "exactly-once overhead per task / 0.5 ms",
            added / 0.5,
            1.0,
            at_most=True,
            note=f"{added:.3f} ms",
        )
    ]
    notes = [
        f"{rounds:,} rounds after {warmup} warm-up rounds; each round runs both tasks once, in "
        "alternating order, through Celery's tracer (task.apply), redelivers the last "
        "committed exactly-once message, and sends the exactly-once statements from a bare "
        "psycopg connection (the floor).",
    ]
    data = {
        **cells,
        **{f"bare {name}": values for name, values in statements.items()},
        **{f"{name} cpu": values for name, values in cpu.items()},
    }
    tables = [("The same statements from a bare psycopg connection", ["", "median ms"], floor_rows)]
    return Section(
        "Exactly-once consumer", header, rows_out, checks, notes, data, errors, tables=tables
    )
