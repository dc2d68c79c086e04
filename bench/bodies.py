"""Storing and replaying a 1 MB body, per way of sending and compressing it:
``python -m bench.bodies`` (a table on stdout).

The testproject's 1 MB receipt goes through a ``store(bytea, text)`` plpgsql function, as
``django_idempotency_store()`` takes it, into tables whose body column TOAST compresses with
pglz or lz4, then is read back and decoded as a replay to a client that does not take
``deflate`` does. The ways, interleaved sample by sample so that drift in the machine's load
hits them alike:

- text: psycopg's ``ClientCursor``, as Django's own cursor (a hex literal out, hex text back);
  the store and its ``COMMIT`` in one message;
- binary: a server-binding cursor with binary results (the body as its bytes both ways); the
  store and its ``COMMIT`` pipelined into one round trip;
- zlib 1: compressed in the app before the write, inflated after the read; lz4: stored as it
  is, compressed by PostgreSQL (pglz likewise, its default where the server has no lz4);
  none: stored as it is and not compressed at all (``STORAGE EXTERNAL``).

Wall time, this process's CPU and the database backend's (from ``/proc/<pid>/schedstat``)
per operation are medians. Uses a scratch database on the ``DATABASE_URL`` server
(or the embedded one), dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg
from psycopg import ClientCursor, Cursor

SIZE = 1024 * 1024
SCRATCH = "idempotency_bench_bodies"


@dataclass(frozen=True)
class Way:
    name: str
    table: str  # t_pglz or t_lz4: the column's TOAST compression
    zlib: bool  # compressed in the app
    binary: bool  # server-side binding, binary results


WAYS = (
    Way("text, zlib 1", "t_pglz", True, False),
    Way("binary, zlib 1", "t_pglz", True, True),
    Way("binary, lz4", "t_lz4", False, True),
    Way("binary, pglz", "t_pglz", False, True),
    Way("text, lz4", "t_lz4", False, False),
    Way("binary, none", "t_none", False, True),
)
# How TOAST treats each table's body column (none: out of line, uncompressed).
TABLES = {
    "t_pglz": "SET COMPRESSION pglz",
    "t_lz4": "SET COMPRESSION lz4",
    "t_none": "SET STORAGE EXTERNAL",
}


@dataclass
class Samples:
    wall: list[float] = field(default_factory=list)
    app: list[float] = field(default_factory=list)
    db: list[float] = field(default_factory=list)

    def row(self) -> list[str]:
        return [
            f"{statistics.median(self.wall):.2f}",
            f"{statistics.median(self.app):.2f}",
            f"{statistics.median(self.db):.2f}",
        ]


def receipt() -> bytes:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from testproject.payments import receipts

    charge = {"id": 1, "amount": 2499, "currency": "inr", "status": "succeeded"}
    body = json.dumps(receipts.receipt(charge, 1, SIZE), separators=(",", ":")).encode()
    assert len(body) == SIZE
    return body


def backend_cpu_ms(pid: int) -> float:
    """A backend's CPU time so far, in nanoseconds from the scheduler (psutil's 10 ms ticks
    are too coarse for one operation); NaN when the server is on another machine."""
    try:
        with open(f"/proc/{pid}/schedstat") as stat:
            return int(stat.read().split()[0]) / 1e6
    except OSError:
        return math.nan


def timed(
    conn: psycopg.Connection,
    action: Callable[[psycopg.Connection, Way, bytes], None],
    way: Way,
    body: bytes,
    into: Samples,
) -> None:
    pid = conn.info.backend_pid
    db, app, wall = backend_cpu_ms(pid), time.thread_time(), time.perf_counter()
    action(conn, way, body)
    into.wall.append((time.perf_counter() - wall) * 1000)
    into.app.append((time.thread_time() - app) * 1000)
    into.db.append(backend_cpu_ms(pid) - db)


def store(conn: psycopg.Connection, way: Way, body: bytes) -> None:
    stored, encoding = (zlib.compress(body, 1), "zlib") if way.zlib else (body, "")
    sql = f"SELECT store_{way.table}(%s, %s)"
    if way.binary:
        with Cursor(conn) as cursor, conn.pipeline():
            cursor.execute(sql, [stored, encoding])
            cursor.execute("COMMIT")
    else:
        ClientCursor(conn).execute(sql + "; COMMIT", [stored, encoding])


def replay(conn: psycopg.Connection, way: Way, body: bytes) -> None:
    sql = f"SELECT body, encoding FROM {way.table} ORDER BY id DESC LIMIT 1"
    cursor = Cursor(conn) if way.binary else ClientCursor(conn)
    row = cursor.execute(sql, binary=way.binary).fetchone()
    assert row is not None
    stored, encoding = bytes(row[0]), row[1]
    if (zlib.decompress(stored) if encoding == "zlib" else stored) != body:
        raise SystemExit(f"{way.name}: the replayed body differs")
    conn.commit()


def measure(url: str, samples: int, warmup: int) -> dict[str, dict[str, Samples]]:
    body = receipt()
    conn = psycopg.connect(url, prepare_threshold=None)
    for table, toast in TABLES.items():
        conn.execute(
            f"CREATE TABLE {table} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            f"body bytea, encoding text)"
        )
        conn.execute(f"ALTER TABLE {table} ALTER COLUMN body {toast}")
        conn.execute(
            f"CREATE FUNCTION store_{table}(p_body bytea, p_encoding text) RETURNS void "
            f"LANGUAGE plpgsql AS $$ BEGIN INSERT INTO {table} (body, encoding) "
            f"VALUES (p_body, p_encoding); END $$"
        )
    conn.commit()
    found = {way.name: {"store": Samples(), "replay": Samples()} for way in WAYS}
    for n in range(warmup + samples):
        for way in WAYS:
            seen = found[way.name] if n >= warmup else {"store": Samples(), "replay": Samples()}
            conn.execute("SELECT 1")  # the claim's transaction, open before the store
            timed(conn, store, way, body, seen["store"])
            timed(conn, replay, way, body, seen["replay"])
    for table in TABLES:
        row = conn.execute(
            f"SELECT pg_column_size(body) FROM {table} WHERE encoding = '' LIMIT 1"
        ).fetchone()
        print(f"{table}: a raw 1 MB body takes {row and row[0]:,} bytes on disk")
    zipped = len(zlib.compress(body, 1))
    print(f"zlib level 1: {zipped:,} bytes")
    conn.close()
    return found


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bodies", description=__doc__)
    p.add_argument("--samples", type=int, default=40, help="stores and replays per way")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(list(argv) if argv is not None else None)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.server import database_url

    url = database_url(None, reset=True, name=SCRATCH)
    try:
        found = measure(url, args.samples, args.warmup)
    finally:
        base = url.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{SCRATCH}" WITH (FORCE)')
    print(f"1 MB receipt, {args.samples} samples per way; load average {psutil.getloadavg()}")
    print("way             | store: wall, app CPU, db CPU ms | replay: wall, app CPU, db CPU ms")
    for name, parts in found.items():
        print(f"{name:15} | {' '.join(parts['store'].row())} | {' '.join(parts['replay'].row())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
