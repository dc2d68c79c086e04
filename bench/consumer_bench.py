"""Exactly-once consumers: what ``ExactlyOnceTask`` adds to a task, against the same plain task.

Both tasks run one business ``INSERT`` and commit it; the plain one in its own
``transaction.atomic()``, the exactly-once one in the unit of work (claim, body, stored JSON
result, commit). Each call is ``task.apply(task_id=...)``: Celery's tracer, as a worker runs a
task, without a broker, whose cost is the same for both and would only add noise. The calls
alternate (plain, exactly-once, in an order reversed every other round) so that drift in the
machine's load hits both alike; the overhead is the difference of the medians. A third cell
times a redelivery of an already committed message (the replay).

``python -m bench consumer``.
"""

from __future__ import annotations

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


def setup_django(url: str) -> None:
    os.environ.update(django_env(url))
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def make_tasks() -> tuple[Any, Any]:
    from celery import Celery
    from django.db import connection, transaction

    from django_idempotency.messaging.consumers import ExactlyOnceTask

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


def timed(task: Any, n: int, task_id: str) -> float:
    started = time.perf_counter()
    result = task.apply((n, 2499), task_id=task_id)
    elapsed = time.perf_counter() - started
    if result.state != "SUCCESS":
        raise RuntimeError(f"{task.name} ended {result.state}: {result.result!r}")
    return elapsed


def run(options: Options) -> Section:
    quick = options.requests <= 100
    rounds = 500 if quick else 3000
    warmup = 50 if quick else 200
    setup_django(options.database_url)
    from django.db import connection

    from django_idempotency.models import IdempotencyRecord

    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cursor.execute(f"CREATE TABLE {TABLE} (id bigserial PRIMARY KEY, n int, amount int)")
    plain, once = make_tasks()
    cells: dict[str, list[float]] = {"plain": [], "exactly-once": [], "redelivery": []}
    committed: list[str] = []
    errors: list[str] = []
    for n in range(warmup + rounds):
        order = [("plain", plain), ("exactly-once", once)]
        if n % 2:
            order.reverse()
        for name, task in order:
            message_id = str(uuid.uuid4())
            seconds = timed(task, n, message_id)
            if n >= warmup:
                cells[name].append(seconds)
                if task is once:
                    committed.append(message_id)
        if n >= warmup and committed:
            cells["redelivery"].append(timed(once, n, committed[-1]))
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {TABLE}")
        (rows,) = cursor.fetchone() or (0,)
        cursor.execute(f"DROP TABLE {TABLE}")
    if rows != 2 * (warmup + rounds):
        errors.append(f"{rows} business rows, not {2 * (warmup + rounds)}: a task ran twice")
    IdempotencyRecord.objects.filter(scope="consumer:bench.consumer.once").delete()
    ms = 1000.0
    medians = {name: median(values) * ms for name, values in cells.items()}
    added = medians["exactly-once"] - medians["plain"]
    header = ["task", "median ms", "p99 ms"]
    rows_out = [
        [name, f"{medians[name]:.3f}", f"{percentile(values, 99) * ms:.3f}"]
        for name, values in cells.items()
    ]
    rows_out.append(["added by ExactlyOnceTask (median)", f"{added:.3f}", ""])
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
        "alternating order, through Celery's tracer (task.apply), and redelivers the last "
        "committed exactly-once message.",
    ]
    data = {name: values for name, values in cells.items()}
    return Section("Exactly-once consumer", header, rows_out, checks, notes, data, errors)
