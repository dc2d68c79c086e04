"""Statements and round trips per request, and the time to store a 1 MB response:
``python -m bench.round_trips`` (JSON on stdout; ``python -m bench request`` runs it).

Each mode's request goes through Django's WSGI handler in this process, as gunicorn calls
it (so ``request_started``/``request_finished`` run, with the connection health check they
schedule), with libpq's trace on the database connection. In the trace, every
``ReadyForQuery`` the server sends ends one round trip and every ``CommandComplete`` ends
one statement: a store pipelined with its ``COMMIT`` is two statements in one round trip. The
modes "claim first" post to the charges that ``bench.floor_views`` serves with
``lookup_first`` off.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import psutil

from bench.request_bench import (
    CHARGE_MODES,
    FIRST_MODES,
    FLOOR_MODES,
    NEW_KEY,
    STORED_KEY,
    TOKEN,
    Mode,
)

STORED_BYTES = 1024 * 1024
# "B   25 CommandComplete	 "INSERT 0 1"" (the timestamps are suppressed).
TRACE_LINE = re.compile(r"^B\t\d+\t(CommandComplete|ReadyForQuery)\t(.*)$")


SENT_LINE = re.compile(r'^F\t\d+\t(?:Query|Parse)\t (?:"[^"]*" )?"(.*)"')
# What a statement of the request path is, by what it contains; else its first words.
KNOWN = (
    ("django_idempotency_store", "store"),
    ("django_idempotency_claim", "claim"),
    ("django_idempotency_lookup", "lookup"),
    ("FROM django_idempotency_record", "lookup"),
    ("authtoken_token", "auth"),
    ("nextval", "nextval"),
    ('INSERT INTO "payments_', "INSERT"),
)


def label(sql: str) -> str:
    # The claim travels with its BEGIN, the store with its COMMIT: one round trip each.
    statement, commits = sql.rstrip(), False
    if statement.startswith("BEGIN; "):
        return "BEGIN+" + label(statement.removeprefix("BEGIN; "))
    if statement.endswith("; COMMIT"):
        statement, commits = statement.removesuffix("; COMMIT"), True
    name = next((known for needle, known in KNOWN if needle in statement), None)
    if name is None:
        words = statement.split()
        name = "health check" if statement == "SELECT 1" else " ".join(words[:2])
    return name + "+COMMIT" if commits else name


def parse_trace(text: str) -> tuple[list[str], list[str], int]:
    """From a libpq trace: the command tags of the statements the server ran, what the
    client sent (one label per round trip: statements pipelined into one are joined by
    "+"), and the round trips."""
    tags, sent, trips = [], [], 0
    waiting = False  # something was sent that the server has not yet answered
    for line in text.splitlines():
        if (query := SENT_LINE.match(line)) is not None:
            if waiting:
                sent[-1] += "+" + label(query.group(1))
            else:
                sent.append(label(query.group(1)))
            waiting = True
        match = TRACE_LINE.match(line)
        if match is None:
            continue
        if match.group(1) == "ReadyForQuery":
            trips += 1
            waiting = False
        else:
            tags.append(match.group(2).strip().strip('"').split(" ")[0])
    return tags, sent, trips


class TraceResult:
    """What a libpq trace saw, filled in when it ends."""

    def __init__(self) -> None:
        self.parsed: tuple[list[str], list[str], int] = ([], [], 0)

    @property
    def statements(self) -> list[str]:
        return self.parsed[0]

    @property
    def sent(self) -> list[str]:
        return self.parsed[1]

    @property
    def round_trips(self) -> int:
        return self.parsed[2]


@contextmanager
def libpq_trace(pgconn: Any) -> Iterator[TraceResult]:
    """Trace a psycopg connection's protocol messages while the block runs."""
    from psycopg.pq import Trace

    found = TraceResult()
    with tempfile.NamedTemporaryFile("r", suffix=".trace") as trace_file:
        # psycopg opens a stdio stream on the descriptor and never closes it: give it a
        # copy, closed below once the stream is flushed and libpq has let go of it.
        copy = os.dup(trace_file.fileno())
        pgconn.trace(copy)
        pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield found
        finally:
            pgconn.untrace()
            ctypes.CDLL(None).fflush(None)  # every stdio stream: the one above is buffered
            os.close(copy)
        with open(trace_file.name) as written:
            # Not trace_file.read(): the copy shared its offset, now at the end.
            found.parsed = parse_trace(written.read())


class Traced:
    """One request through Django's WSGI handler with libpq tracing the connection."""

    def __init__(self) -> None:
        from django.core.handlers.wsgi import WSGIHandler
        from django.test import RequestFactory

        self.handler = WSGIHandler()
        self.factory = RequestFactory(SERVER_NAME="127.0.0.1")

    def post(
        self, path: str, body: bytes, headers: dict[str, str], trace: bool = False
    ) -> tuple[int, dict[str, str], bytes, tuple[list[str], list[str], int]]:
        from django.db import connection

        request = self.factory.post(
            path,
            body,
            content_type="application/json",
            headers={"Authorization": f"Token {TOKEN}", **headers},
        )
        answer: list[Any] = []

        def start_response(
            status: str, response_headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], object]:
            answer[:] = [int(status[:3]), {k.lower(): v for k, v in response_headers}]
            return lambda data: None

        # Opened before the request so that the trace sees every statement of it (a
        # connection opened by the request itself would not be traced).
        connection.ensure_connection()
        context = libpq_trace(connection.connection.pgconn) if trace else nullcontext()
        with context as traced:
            result = self.handler(request.environ, start_response)
            try:
                content = b"".join(result)
            finally:
                result.close()  # request_finished, as a WSGI server sends it
        parsed = traced.parsed if traced is not None else ([], [], 0)
        return answer[0], answer[1], content, parsed


def count(traced: Traced, samples: int) -> dict[str, Any]:
    """Statements and round trips of each mode of the request benchmark (its sequential
    ones, the floors included), the same in every sample or flagged."""
    modes = (*CHARGE_MODES, *FIRST_MODES, *FLOOR_MODES)
    # A stored key per pool that a mode replays from, stored by the mode that feeds it.
    stored: dict[str, str] = {}
    for feeder in modes:
        if feeder.key == NEW_KEY and any(
            m.pool == feeder.pool for m in modes if m.key == STORED_KEY
        ):
            stored[feeder.pool] = key = str(uuid.uuid4())
            status, _, content, _ = traced.post(feeder.path, feeder.body, {"Idempotency-Key": key})
            if status != 201:
                raise SystemExit(f"priming {feeder.pool}: {status} {content[:300]!r}")

    def headers(mode: Mode) -> dict[str, str]:
        if mode.key == NEW_KEY:
            return {"Idempotency-Key": str(uuid.uuid4())}
        if mode.key == STORED_KEY:
            return {"Idempotency-Key": stored[mode.pool]}
        return {}

    found: dict[str, Any] = {}
    for mode in modes:
        runs = []
        for n in range(samples + 2):
            # Two warm-ups: plans, caches.
            sent = traced.post(mode.path, mode.body, headers(mode), trace=n >= 2)
            status, head, content, parsed = sent
            replayed = head.get("idempotent-replayed") == "true"
            if status != 201 or replayed != (mode.key == STORED_KEY):
                raise SystemExit(f"{mode.name}: {status} replayed={replayed} {content[:300]!r}")
            if n >= 2:
                runs.append(parsed)
        tags, sent, trips = runs[-1]
        found[mode.name] = {
            "statements": len(tags),
            "round_trips": trips,
            "commands": tags,
            "sent": sent,
            "steady": all(run == runs[-1] for run in runs),
        }
    return found


def store_time(traced: Traced, samples: int) -> dict[str, Any]:
    """Encoding (compressing, unless PostgreSQL does) and storing a 1 MB response with its
    COMMIT, as the engine does after the claim; the body is a 1 MB receipt of the
    testproject."""
    from django.db import transaction

    from bench.floor_views import claim_key, finished
    from django_idempotency.conf import conf
    from django_idempotency.storage import bodies
    from django_idempotency.storage import records as storage

    body = json.dumps({"amount": 2499, "currency": "inr", "size": STORED_BYTES}).encode()
    status, _, content, _ = traced.post("/api/receipts-plain/", body, {})
    if status != 201 or len(content) != STORED_BYTES:
        raise SystemExit(f"1 MB receipt: {status} {len(content)} bytes {content[:300]!r}")
    from django.db import connection

    compress, write, total, app_cpu, db_cpu = [], [], [], [], []
    stored_bytes, stored_encoding = 0, ""
    for n in range(samples + 2):
        principal, key = "bench:store", str(uuid.uuid4())
        with transaction.atomic():
            claimed = claim_key(principal, key)
            backend = _backend_cpu(connection.connection.info.backend_pid)
            cpu = time.thread_time()
            started = time.perf_counter()
            stored, encoding = bodies.encode_body("default", content, conf.COMPRESS_MIN_BYTES)
            encoded = time.perf_counter()
            record = finished(
                principal,
                key,
                claimed,
                path="/api/receipts/",
                code=201,
                headers=[["Content-Type", "application/json"]],
                body=stored,
                encoding=encoding,
            )
            storage.store("default", record, row_id=None, commit=True)
            done = time.perf_counter()
            cpu = time.thread_time() - cpu
            backend_used = _backend_cpu(connection.connection.info.backend_pid) - backend
        if n >= 2:
            app_cpu.append(cpu * 1000)
            db_cpu.append(backend_used * 1000)
            compress.append((encoded - started) * 1000)
            write.append((done - encoded) * 1000)
            total.append((done - started) * 1000)
            stored_bytes, stored_encoding = len(stored), encoding
    with connection.cursor() as cursor:
        # What TOAST made of the last one (lz4, or pglz on a stored zlib body).
        cursor.execute(
            "SELECT pg_column_size(response_body) FROM django_idempotency_record "
            "WHERE scope = %s AND key = %s",
            [principal, key],
        )
        (on_disk,) = cursor.fetchone()
    return {
        "body_bytes": len(content),
        "stored_bytes": stored_bytes,
        "encoding": stored_encoding,
        "on_disk_bytes": on_disk,
        "compress_ms": statistics.median(compress),
        "write_and_commit_ms": statistics.median(write),
        "total_ms": statistics.median(total),
        # CPU time, which the machine's load hardly moves: this process's (compression,
        # sending) and the database backend's (the write, TOAST, WAL, commit).
        "app_cpu_ms": statistics.median(app_cpu),
        # A mean: the kernel counts a process's CPU time in ticks of 10 ms.
        "db_cpu_ms": statistics.fmean(db_cpu),
        "total_ms_all": total,
    }


def _backend_cpu(pid: int) -> float:
    """CPU seconds of a database backend; NaN when the server is on another machine."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return math.nan
    return float(times.user + times.system)


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.round_trips", description=__doc__)
    p.add_argument("--samples", type=int, default=5, help="traced requests per mode")
    p.add_argument("--stores", type=int, default=20, help="1 MB stores timed")
    p.add_argument("--database-url", help="as for python -m bench")
    args = p.parse_args(list(argv) if argv is not None else None)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.server import database_url, django_env

    os.environ.update(django_env(database_url(args.database_url)))
    # The testproject's URLs and the floor views, as the benchmark's gunicorn serves them.
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    import django

    django.setup()
    traced = Traced()
    result = {"modes": count(traced, args.samples), "store_1mb": store_time(traced, args.stores)}
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
