"""The claim in the database before and after migration 0010 (versions, tombstones), side by side.

One run, in a database of its own (dropped afterwards): 0007's claim is created beside 0010's
under another name, 200,000 records are loaded, and each variant runs 20,000 claims in a
``DO`` loop (the database's time alone, no client round trips), six rounds interleaved.
Prints the median microseconds per claim and the ratio to 0007's.

0007 and 0010 are in tests/support/old_migrations, the chain squashed into 0.1.0's 0001.

``python -m bench.claim_versions``
"""

from __future__ import annotations

import importlib
import statistics
import time

from bench.partitions_bench import drop_database, execute, own_database, setup_django

DATABASE = "idempotency_bench_claim_versions"
CALLS = 20_000
ROUNDS = 6
ARGS = "interval '1 day', interval '0', 0"
FRESH = "'user:1', md5(i::text || 'fresh')"
FOUND = "'user:' || (i % 1000), md5(i::text)"
# What the app sends as the tombstone's principal (storage.erasure.tombstone_scope, cached).
ERASED = "'erased:' || repeat('0', 64)"
VARIANTS = {
    "0007, fresh key": f"claim_0007(1, {FRESH}, {ARGS})",
    "0010, fresh key": f"django_idempotency_claim(1, {FRESH}, {ARGS}, NULL, NULL, {ERASED})",
    "0010, fresh key, versioned": (
        f"django_idempotency_claim(1, {FRESH}, {ARGS}, NULL, 'v1', {ERASED})"
    ),
    "0007, replay": f"claim_0007(1, {FOUND}, {ARGS})",
    "0010, replay": f"django_idempotency_claim(1, {FOUND}, {ARGS}, NULL, NULL, {ERASED})",
    "0010, replay, versioned": (
        f"django_idempotency_claim(1, {FOUND}, {ARGS}, NULL, 'v1', {ERASED})"
    ),
}


def main() -> None:
    from testproject.database import database_url

    server = database_url()
    url = own_database(server, DATABASE)
    try:
        setup_django(url)
        from django.db import connection

        migration = importlib.import_module(
            "tests.support.old_migrations.0010_response_version_and_tombstones"
        )
        previous = migration.PREVIOUS_CLAIM_FUNCTION.replace(
            "FUNCTION django_idempotency_claim(", "FUNCTION claim_0007("
        )
        with connection.cursor() as cursor:
            cursor.execute(previous, None)
        execute(
            "INSERT INTO django_idempotency_record (scope, key, method, path, fingerprint, "
            "status, response_code, response_headers, response_body, created_at, expires_at, "
            "response_version) SELECT 'user:' || (g % 1000), md5(g::text), 'POST', '/p', "
            "'{}', 1, 201, '[]', 'x'::bytea, now() - interval '1 hour' * (g % 20) / 20, "
            "now() + interval '1 day', 'v1' FROM generate_series(1, 200000) g"
        )
        execute("VACUUM ANALYZE django_idempotency_record")
        spent: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(ROUNDS):
            for name, call in VARIANTS.items():
                started = time.perf_counter()
                # One lock id throughout: advisory locks are re-entrant, so one entry.
                execute(
                    f"DO $$ BEGIN FOR i IN 1..{CALLS} LOOP PERFORM * FROM {call}; END LOOP; END $$"
                )
                spent[name].append((time.perf_counter() - started) / CALLS * 1e6)
        medians = {name: statistics.median(times) for name, times in spent.items()}
        for name, median in medians.items():
            base = medians["0007, replay" if "replay" in name else "0007, fresh key"]
            print(f"{name:28} {median:6.1f} µs per claim  {median / base:5.2f}x")
        connection.close()
    finally:
        drop_database(server, DATABASE)


if __name__ == "__main__":
    main()
