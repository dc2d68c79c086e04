"""Erasure on a large table: one principal's records among 10 million become tombstones.

One run, in a database of its own (``idempotency_bench_erasure``, dropped afterwards unless
``--keep``): ``--rows`` completed records spread over ten daily partitions and ``--principals``
principals, with small bodies (the scan reads the heap, not the TOASTed bodies). Then
``storage.erasure.erase`` erases one principal (the command's work), and again (nothing left).
Prints the rows read per second and the total time of each run.

``python -m bench.erasure [--database-url URL] [--rows N] [--keep]``
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime, timedelta

from bench.partitions_bench import drop_database, execute, own_database, setup_django

DATABASE = "idempotency_bench_erasure"
TABLE = "django_idempotency_record"
DAYS = 10


def load(rows: int, principals: int) -> None:
    """``rows`` records over the ten days before tomorrow, ``principals`` principals."""
    from django.db import connection

    from django_idempotency.partitions.apply import create_partition
    from django_idempotency.partitions.tables import RECORDS

    today = datetime.now(UTC).date()
    days = [today - timedelta(days=n) for n in range(DAYS - 1, -1, -1)]
    for day in days:
        create_partition(connection, RECORDS, day, retry_for=timedelta(seconds=30))
    per_day = rows // DAYS
    for day in days:
        start = datetime(day.year, day.month, day.day, tzinfo=UTC)
        execute(
            f"INSERT INTO {TABLE} (scope, key, method, path, fingerprint, status, "
            "response_code, response_headers, response_body, created_at, expires_at) "
            "SELECT 'user:' || (g %% %s), md5(g::text || %s), 'POST', '/api/charges/', "
            """'{"body": "0123456789abcdef"}', 1, 201, '[["Content-Type", "application/json"]]', """
            """'{"id": 1, "amount": 2499}'::bytea, t.at, t.at + interval '1 day' """
            "FROM generate_series(0, %s - 1) g, "
            "LATERAL (SELECT %s::timestamptz + interval '1 day' * g / %s AS at) t",
            [principals, day.isoformat(), per_day, start.isoformat(), per_day],
        )
    execute(f"VACUUM (ANALYZE) {TABLE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--principals", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    from testproject.database import database_url

    server = args.database_url or database_url()
    url = own_database(server, DATABASE)
    try:
        setup_django(url)
        from django.db import connection

        from django_idempotency.storage.erasure import BATCH, erase

        started = time.perf_counter()
        load(args.rows, args.principals)
        print(f"loaded {args.rows:,} records in {time.perf_counter() - started:.0f} s")
        batch = args.batch or BATCH
        for run in ("erase", "again"):
            started = time.perf_counter()
            erased = erase(connection.alias, "user:42", batch=batch)
            took = time.perf_counter() - started
            print(
                f"{run}: {erased} records of user:42 erased; {args.rows:,} rows read in "
                f"{took:.1f} s, {args.rows / took:,.0f} rows/s (batches of {batch:,} ids)"
            )
        connection.close()
    finally:
        if not args.keep:
            drop_database(server, DATABASE)


if __name__ == "__main__":
    main()
