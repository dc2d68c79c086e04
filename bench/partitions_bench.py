"""Partition maintenance against DELETE: removing one day of records, and claims meanwhile.

One run, in a database of its own (``idempotency_bench_partitions``, dropped afterwards):
records spread over daily partitions, and the same rows in an unpartitioned copy.

1. Remove the oldest day, with no traffic: the app's maintenance (``maintain()``: mark,
   ``DETACH … CONCURRENTLY``, ``DROP``) against ``DELETE … WHERE expires_at < …`` on the
   copy, then ``VACUUM``. Time and WAL, each after a CHECKPOINT, so full-page images count
   as they would in production.
2. Claims from client processes at a fixed rate (claim function, completing insert,
   commit, as the engine sends them), in windows: quiet; a long transaction open; a long
   transaction open while maintenance drops the next day (it must wait for it); and, as a
   control, a long transaction open while a plain ``DROP TABLE`` drops the day after.

``python -m bench.partitions_bench [--database-url URL] [--quick]``; ``python -m bench
partitions`` when listed in ``bench/run.py``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import date, datetime, timedelta
from functools import partial
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from bench.report import Check, Section, percentile

if TYPE_CHECKING:
    from bench.run import Options

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "idempotency_bench_partitions"
TABLE = "django_idempotency_record"
COPY = "bench_unpartitioned_copy"
BODY_BYTES = 1024
SCOPES = 1000
MIB = 1024 * 1024

# Each statement reports the time it spent in the server, lock waits included; the client
# side adds its own scheduling on a busy machine.
SPENT = "extract(epoch FROM clock_timestamp() - statement_timestamp())"
# The first argument is the key's lock, which the engine derives with a keyed hash.
CLAIM = (
    f"SELECT outcome, created_at, {SPENT} FROM django_idempotency_claim("
    "%s, %s, %s, interval '24 hours', interval '0', 2000)"
)
FINISH = (
    f"INSERT INTO {TABLE} (scope, key, method, path, fingerprint, status, response_code, "
    "response_headers, response_body, created_at, expires_at) VALUES (%s, %s, 'POST', "
    "'/api/charges/', '{}', 1, 201, '[]', %s, %s, %s + interval '24 hours') "
    f"RETURNING {SPENT}"
)
BODY = b'{"id": 1}' + b" " * (BODY_BYTES - 10) + b"}"


@dataclass(frozen=True)
class Settings:
    database_url: str  # any database on the server to use; ours is created next to it
    days: int
    rows_per_day: int
    clients: int
    rate: float  # claims per second, all clients together
    window: float  # seconds per latency window
    rounds: int  # baseline and maintenance windows, alternating
    keep: bool


@dataclass(frozen=True)
class Removal:
    seconds: float
    wal_bytes: int


@dataclass(frozen=True)
class Window:
    name: str
    seconds: float
    client_ms: list[float]
    server_ms: list[float]


# The server and the database -----------------------------------------------------------


def own_database(url: str, name: str = DATABASE) -> str:
    """(Re)create our database (``name``) on the server of ``url``; return its URL."""
    parts = urlsplit(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}"))


def drop_database(url: str, name: str = DATABASE) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ.setdefault("IDEMPOTENCY_LOG_LEVEL", "WARNING")
    sys.path.insert(0, str(ROOT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def execute(sql: str, params: list[Any] | None = None) -> list[Any]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def load(days: list[date], rows_per_day: int) -> None:
    """Completed records spread evenly over each day, then the same rows in the copy."""
    from django.db import connection

    from django_idempotency.partitions.apply import create_partition
    from django_idempotency.partitions.tables import RECORDS

    for day in days:
        create_partition(connection, RECORDS, day, retry_for=timedelta(seconds=30))
    for day in days:
        start = datetime(day.year, day.month, day.day).isoformat() + "+00:00"
        execute(
            f"INSERT INTO {TABLE} (scope, key, method, path, fingerprint, status, "
            "response_code, response_headers, response_body, created_at, expires_at) "
            f"SELECT 'user:' || (g %% {SCOPES}), gen_random_uuid()::text, 'POST', "
            "'/api/charges/', '{}', 1, 201, '[]', %s, t.at, t.at + interval '24 hours' "
            "FROM generate_series(0, %s - 1) g, "
            "LATERAL (SELECT %s::timestamptz + interval '1 day' * g / %s AS at) t",
            [BODY, rows_per_day, start, rows_per_day],
        )
    # An unpartitioned design needs an index on expires_at to find what to delete.
    execute(f"CREATE TABLE {COPY} (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING IDENTITY)")
    execute(f"INSERT INTO {COPY} SELECT * FROM {TABLE}")
    execute(f"ALTER TABLE {COPY} ADD PRIMARY KEY (id), ADD UNIQUE (scope, key)")
    execute(f"CREATE INDEX ON {COPY} (expires_at)")
    for table in (TABLE, COPY):
        execute(f"VACUUM (FREEZE, ANALYZE) {table}")


# 1. Removing one day -------------------------------------------------------------------


def per_backend_wal() -> bool:
    # PostgreSQL 18 counts WAL per backend: our statements' WAL alone, whatever else the
    # server is doing. Older servers: the cluster-wide LSN difference.
    return int(execute("SHOW server_version_num")[0][0]) >= 180000


def wal_position() -> int:
    if per_backend_wal():
        # Pending statistics reach the counter once the backend has been idle; force it.
        execute("SELECT pg_stat_force_next_flush()")
        return int(execute("SELECT wal_bytes FROM pg_stat_get_backend_wal(pg_backend_pid())")[0][0])
    return int(execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0][0])


def measure(action: Any) -> Removal:
    execute("CHECKPOINT")
    wal, started = wal_position(), time.perf_counter()
    action()
    took = time.perf_counter() - started
    return Removal(took, wal_position() - wal)


def keep_for() -> timedelta:
    from django_idempotency.partitions.tables import RECORDS

    return RECORDS.keep_for()


def maintain_dropping(day: date) -> None:
    """Run maintenance at the moment ``day``'s partition first qualifies, so it alone goes."""
    from django.test import override_settings

    from django_idempotency.partitions.catalog import day_bounds
    from django_idempotency.partitions.maintain import maintain
    from django_idempotency.partitions.tables import RECORDS

    now = day_bounds(day)[1] + keep_for()
    # The moment may be days ahead (records kept for a week): create nothing, measure the drop.
    with override_settings(IDEMPOTENCY_PARTITIONS_AHEAD=2):
        report = maintain(now=now)
    assert report.dropped == [RECORDS.partition_name(day)], report.lines()
    assert not report.created, report.lines()


def remove_one_day(day: date) -> dict[str, Removal]:
    from django_idempotency.partitions.catalog import day_bounds
    from django_idempotency.partitions.tables import RECORDS

    partition_name = RECORDS.partition_name
    end = day_bounds(day)[1] + timedelta(hours=24)  # the day's records expire before this
    results = {
        "delete": measure(lambda: execute(f"DELETE FROM {COPY} WHERE expires_at < %s", [end])),
        "vacuum": measure(lambda: execute(f"VACUUM {COPY}")),
    }
    assert not execute(f"SELECT 1 FROM {COPY} WHERE expires_at < %s LIMIT 1", [end])
    assert execute("SELECT to_regclass(%s) IS NOT NULL", [partition_name(day)]) == [(True,)]
    results["maintenance"] = measure(lambda: maintain_dropping(day))
    return results


# 2. Claims while maintenance runs ------------------------------------------------------


def client(url: str, interval: float, stop: EventType, results: Any) -> None:
    """One client: claims at a fixed pace, each in its own transaction, as Django sends
    them (client-side binding, nothing prepared)."""
    samples: list[tuple[float, float, float]] = []
    with psycopg.connect(
        url, autocommit=True, cursor_factory=psycopg.ClientCursor, prepare_threshold=None
    ) as conn:
        due = time.monotonic()
        while not stop.is_set():
            scope, key = f"user:{uuid.uuid4().int % SCOPES}", uuid.uuid4().hex
            began, started = time.time(), time.perf_counter()
            with conn.transaction():
                lock = uuid.uuid4().int % 2**32 - 2**31
                claimed = conn.execute(CLAIM, [lock, scope, key]).fetchone()
                assert claimed is not None and claimed[0] == "won", claimed
                stored = conn.execute(FINISH, [scope, key, BODY, claimed[1], claimed[1]]).fetchone()
                assert stored is not None
            took = time.perf_counter() - started
            samples.append((began, took, float(claimed[2]) + float(stored[0])))
            due += interval
            time.sleep(max(0.0, due - time.monotonic()))
    results.put(samples)


def hold_transaction(url: str, day: date, ready: threading.Event, seconds: float) -> None:
    """A slow request: it has read the day's partition and keeps its transaction open."""
    from django_idempotency.partitions.catalog import day_bounds

    start, end = day_bounds(day)
    with psycopg.connect(url) as conn:
        conn.execute(
            f"SELECT 1 FROM {TABLE} WHERE created_at >= %s AND created_at < %s LIMIT 1",
            [start, end],
        )
        ready.set()
        time.sleep(seconds)
        conn.rollback()


def behind_a_long_transaction(url: str, day: date, hold: float, action: Any) -> tuple[float, float]:
    """Open a long transaction on ``day``'s partition, run ``action`` 0.5 s later;
    return when ``action`` started and ended (wall clock)."""
    ready = threading.Event()
    holder = threading.Thread(target=hold_transaction, args=(url, day, ready, hold))
    holder.start()
    ready.wait(30)
    time.sleep(0.5)
    began = time.time()
    action()
    ended = time.time()
    holder.join()
    return began, ended


def plain_drop(url: str, day: date) -> None:
    from django_idempotency.partitions.tables import RECORDS

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{RECORDS.partition_name(day)}"')


WITHOUT = "long transaction open"
DURING = "long transaction + maintenance"


def claims(url: str, settings: Settings, maintained: list[date], dropped: date) -> list[Window]:
    """Claims in windows; the baseline and maintenance windows alternate, one round per
    day in ``maintained``, so that a burst of load elsewhere on the machine hits both."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    results = context.Queue()
    interval = settings.clients / settings.rate
    processes = [
        context.Process(target=client, args=(url, interval, stop, results))
        for _ in range(settings.clients)
    ]
    for process in processes:
        process.start()
    bounds: dict[str, list[tuple[float, float]]] = {"quiet": [], WITHOUT: [], DURING: []}
    try:
        time.sleep(3)  # connected and warm
        began = time.time()
        time.sleep(settings.window)
        bounds["quiet"].append((began, time.time()))
        for day in maintained:
            hold = settings.window + 0.5
            bounds[WITHOUT].append(
                behind_a_long_transaction(url, day, hold, lambda: time.sleep(settings.window))
            )
            bounds[DURING].append(
                behind_a_long_transaction(url, day, hold, partial(maintain_dropping, day))
            )
        bounds["long transaction + plain DROP (control)"] = [
            behind_a_long_transaction(
                url, dropped, settings.window / 2 + 0.5, partial(plain_drop, url, dropped)
            )
        ]
        time.sleep(1)
    finally:
        stop.set()
        samples = [sample for _ in processes for sample in results.get(timeout=60)]
        for process in processes:
            process.join()
    windows = []
    for name, spans in bounds.items():
        inside = [s for s in samples if any(start <= s[0] <= end for start, end in spans)]
        seconds = sum(end - start for start, end in spans)
        windows.append(
            Window(name, seconds, [s[1] * 1000 for s in inside], [s[2] * 1000 for s in inside])
        )
    return windows


# The run -------------------------------------------------------------------------------


def measure_all(settings: Settings) -> dict[str, Any]:
    url = own_database(settings.database_url)
    try:
        setup_django(url)
        from django.db import connection

        from django_idempotency.partitions.catalog import database_now
        from django_idempotency.partitions.tables import RECORDS

        today = database_now(connection).date()
        days = [today - timedelta(days=n) for n in range(settings.days, 0, -1)]
        started = time.perf_counter()
        load(days, settings.rows_per_day)
        loaded = time.perf_counter() - started
        sizes = {
            "partition_bytes": int(
                execute("SELECT pg_total_relation_size(%s)", [RECORDS.partition_name(days[0])])[0][
                    0
                ]
            ),
            "copy_bytes_before": int(execute("SELECT pg_total_relation_size(%s)", [COPY])[0][0]),
        }
        removal = remove_one_day(days[0])
        sizes["copy_bytes_after"] = int(execute("SELECT pg_total_relation_size(%s)", [COPY])[0][0])
        rounds = days[1 : 1 + settings.rounds]
        windows = claims(url, settings, rounds, days[1 + settings.rounds])
        load_average = os.getloadavg()[1]
        version = str(execute("SHOW server_version")[0][0])
        return {
            "server": version,
            "wal_method": "per backend" if per_backend_wal() else "cluster LSN",
            "records": settings.days * settings.rows_per_day,
            "load_seconds": loaded,
            "load": load_average,
            "sizes": sizes,
            "removal": {name: asdict(r) for name, r in removal.items()},
            "windows": [asdict(w) for w in windows],
        }
    finally:
        from django.db import connections

        connections.close_all()
        if not settings.keep:
            drop_database(settings.database_url)


def section(settings: Settings, data: dict[str, Any]) -> Section:
    removal = {name: Removal(**r) for name, r in data["removal"].items()}
    windows = {w["name"]: Window(**w) for w in data["windows"]}
    header = ["", "seconds", "WAL MiB", "claims", "p50 ms", "p99 ms", "max ms", "in db p99/max"]
    rows = [
        [
            "DELETE one day, unpartitioned copy",
            f"{removal['delete'].seconds:.3f}",
            f"{removal['delete'].wal_bytes / MIB:.2f}",
            "",
            "",
            "",
            "",
            "",
        ],
        [
            "  then VACUUM",
            f"{removal['vacuum'].seconds:.3f}",
            f"{removal['vacuum'].wal_bytes / MIB:.2f}",
            "",
            "",
            "",
            "",
            "",
        ],
        [
            "maintenance: detach + drop one day",
            f"{removal['maintenance'].seconds:.3f}",
            f"{removal['maintenance'].wal_bytes / MIB:.3f}",
            "",
            "",
            "",
            "",
            "",
        ],
    ]
    for name, w in windows.items():
        rows.append(
            [
                f"claims, {name}",
                f"{w.seconds:.2f}",
                "",
                str(len(w.client_ms)),
                f"{percentile(w.client_ms, 50):.1f}",
                f"{percentile(w.client_ms, 99):.1f}",
                f"{max(w.client_ms):.1f}",
                f"{percentile(w.server_ms, 99):.1f} / {max(w.server_ms):.1f}",
            ]
        )
    without, during = windows[WITHOUT], windows[DURING]
    sizes = data["sizes"]
    delete, dropping = removal["delete"].seconds, removal["maintenance"].seconds
    checks = [
        Check(
            "WAL of DELETE / WAL of maintenance (one day)",
            removal["delete"].wal_bytes / max(1, removal["maintenance"].wal_bytes),
            1000,
            at_most=False,
            note=f"WAL {data['wal_method']}",
        ),
        # In the database: where maintenance could make a claim wait (locks), and what a
        # busy machine's scheduling does not blur. Client-side figures are in the table.
        Check(
            "claim p99 in db: during maintenance / without",
            percentile(during.server_ms, 99) / percentile(without.server_ms, 99),
            1.2,
            at_most=True,
            note="long transaction open in both",
        ),
        Check(
            "slowest claim in db during maintenance / 100 ms",
            max(during.server_ms) / 100,
            1.0,
            at_most=True,
            note=f"{max(during.server_ms):.1f} ms",
        ),
    ]
    notes = [
        f"PostgreSQL {data['server']}; {data['records']:,} records over {settings.days} daily "
        f"partitions ({settings.rows_per_day:,} a day, {BODY_BYTES} B bodies), loaded in "
        f"{data['load_seconds']:.0f} s; the same rows in an unpartitioned copy.",
        f"One day's partition: {sizes['partition_bytes'] / MIB:.0f} MiB, space given back at "
        f"once. The copy: {sizes['copy_bytes_before'] / MIB:.0f} MiB before DELETE + VACUUM, "
        f"{sizes['copy_bytes_after'] / MIB:.0f} MiB after.",
        "Client side: claim p99 during maintenance / without "
        f"{percentile(during.client_ms, 99) / percentile(without.client_ms, 99):.2f}x, slowest "
        f"{max(during.client_ms):.1f} ms (quiet window: {max(windows['quiet'].client_ms):.1f} ms).",
        f"Time ratio DELETE / maintenance: {delete / dropping:.1f}x (with VACUUM: "
        f"{(delete + removal['vacuum'].seconds) / dropping:.1f}x).",
        f"Claims: {settings.clients} client processes, {settings.rate:.0f}/s in all, "
        f"{settings.rounds} rounds of a baseline window then a maintenance window (pooled); "
        "p50/p99/max as the client saw them, 'in db' the time the claim and the insert "
        "spent in the server (lock waits included). The long transaction has read the "
        "partition being dropped: maintenance waits for it (its window lasts as long), a "
        "plain DROP makes every claim wait with it. Load average during the run: "
        f"{data['load']:.1f} on "
        f"{os.cpu_count()} CPUs.",
    ]
    return Section(
        title="partitions: removing one day; claims while maintenance runs",
        header=header,
        rows=rows,
        checks=checks,
        notes=notes,
        data={"settings": asdict(settings), **data},
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.partitions_bench", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--database-url",
        help="a database on the server to use (default: DATABASE_URL, else the embedded server)",
    )
    p.add_argument("--days", type=int, default=7, help="past daily partitions (default: 7)")
    p.add_argument(
        "--rows-per-day", type=int, default=200_000, help="records a day (default: 200000)"
    )
    p.add_argument("--clients", type=int, default=8, help="client processes (default: 8)")
    p.add_argument(
        "--rate", type=float, default=200.0, help="claims per second, all clients (default: 200)"
    )
    p.add_argument(
        "--window", type=float, default=10.0, help="seconds per latency window (default: 10)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating baseline and maintenance windows (default: 3)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="20,000 records a day and 3 s windows; figures only indicative",
    )
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)  # for run()
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    if args.days < args.rounds + 2:
        raise SystemExit("--days must leave one day to delete, one per round and a control")
    url = args.database_url
    if not url:
        sys.path.insert(0, str(ROOT))
        from testproject.database import database_url

        url = database_url()
    return Settings(
        database_url=url,
        days=args.days,
        rows_per_day=20_000 if args.quick else args.rows_per_day,
        clients=args.clients,
        rate=args.rate,
        window=3.0 if args.quick else args.window,
        rounds=1 if args.quick else args.rounds,
        keep=args.keep,
    )


def main(argv: list[str] | None = None) -> int:
    from bench.report import render

    args = parser().parse_args(argv)
    settings = settings_from(args)
    result = section(settings, measure_all(settings))
    if args.json:
        args.json.write_text(json.dumps(asdict(result), default=str))
    else:
        print(render(result))
    return 0 if result.passed else 1


def run(options: Options) -> Section:
    """For ``python -m bench``: the same run in a child process, which sets Django up for
    its own database."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "section.json"
        argv = [
            "--database-url",
            options.database_url,
            "--clients",
            str(options.clients),
            "--json",
            str(out),
        ]
        if options.duration < 5:
            argv.append("--quick")
        done = subprocess.run(
            [sys.executable, "-m", "bench.partitions_bench", *argv], cwd=ROOT, check=False
        )
        if not out.exists():
            return Section("partitions", [], [], [], errors=[f"exit status {done.returncode}"])
        raw = json.loads(out.read_text())
    raw["checks"] = [Check(**check) for check in raw["checks"]]
    return Section(**raw)


if __name__ == "__main__":
    sys.exit(main())
