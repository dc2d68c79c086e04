"""Time the records admin on a large partitioned table, through the Django test client.

    python bench/admin_bench.py [--rows 10000000] [--days 10] [--repeat 5] [--reload]

Loads ``--rows`` records (default 10 million) spread evenly over the last ``--days`` daily
partitions into its own database, ``idempotency_admin_bench``, on the server of
``DATABASE_URL`` (else the embedded server), and keeps them for the next run on the same
day: loading 10 million rows takes several minutes and about 7 GB. Then it requests the
changelist, the searches, every filter and a detail page as a superuser, and prints for each
the median and the fastest time of the whole request, its number of queries and the time
spent in them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "idempotency_admin_bench"
CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"

# One row per generate_series value, created_at evenly spaced from ``start`` by ``step``,
# ids in the same order. The mix is a payments API's, each column drawn from its own hash so
# that filters combine as they would on real data: 10% PATCH (on /api/charges/ only), POST
# on three endpoints, mostly 201, 8% 4xx, and 0.1% redirects (answered to POST only);
# bodies of about 150 bytes.
INSERT = """
INSERT INTO django_idempotency_record
    (scope, key, method, path, fingerprint, status, response_code, response_headers,
     response_body, body_encoding, created_at, expires_at)
SELECT 'user:' || mod(i, 20000),
       md5(i::text)::uuid::text,
       CASE WHEN patch THEN 'PATCH' ELSE 'POST' END,
       CASE WHEN patch THEN '/api/charges/'
            WHEN mod(abs(hashtext('path' || i)), 20) = 0 THEN '/api/charges-django/'
            WHEN mod(abs(hashtext('path' || i)), 20) < 6 THEN '/api/refunds/'
            ELSE '/api/charges/' END,
       jsonb_build_object(
           'method', md5('m' || i) || md5('M' || i), 'path', md5('p' || i) || md5('P' || i),
           'query', md5('q' || i) || md5('Q' || i), 'body', md5('b' || i) || md5('B' || i)),
       1,
       CASE WHEN response = 0 AND NOT patch THEN 303 WHEN response < 20 THEN 422
            WHEN response < 80 THEN 400 ELSE 201 END,
       '[["Content-Type", "application/json"]]'::jsonb,
       convert_to(json_build_object(
           'id', i, 'amount', mod(i, 100000), 'currency', 'EUR',
           'description', 'Order ' || md5(i::text))::text, 'UTF8'),
       '',
       %(start)s::timestamptz + (i - 1) * %(step)s::interval,
       %(start)s::timestamptz + (i - 1) * %(step)s::interval + interval '24 hours'
  FROM generate_series(%(low)s::bigint, %(high)s::bigint) AS i,
       LATERAL (SELECT mod(abs(hashtext('method' || i)), 10) = 0 AS patch,
                       mod(abs(hashtext('response' || i)), 1000) AS response) AS drawn
"""


def load(rows: int, days: int, reload: bool) -> None:
    from django.db import connection
    from django.utils import timezone

    from django_idempotency.partitions.apply import create_partition
    from django_idempotency.partitions.tables import RECORDS

    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM (SELECT 1 FROM django_idempotency_record LIMIT %s) t", [rows + 1]
        )
        (present,) = cursor.fetchone()
        cursor.execute("SELECT max(created_at) FROM django_idempotency_record")
        (newest,) = cursor.fetchone()
    # Rows loaded on another day no longer sit where the "last hour" and day filters look.
    if present == rows and newest > now - timedelta(hours=6) and not reload:
        print(f"reusing {rows:,} records (--reload to load them again)", flush=True)
        return
    first = now - timedelta(days=days) + timedelta(seconds=1)
    for n in range(days + 1):
        day = (first + timedelta(days=n)).date()
        create_partition(connection, RECORDS, day, retry_for=timedelta(seconds=30))
    step = timedelta(days=days) / rows
    chunk = max(1, rows // (days * 4))
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_idempotency_record")
        for low in range(1, rows + 1, chunk):
            high = min(rows, low + chunk - 1)
            cursor.execute(INSERT, {"low": low, "high": high, "start": first, "step": step})
            print(f"  {high:,} / {rows:,} rows, {time.monotonic() - started:.0f} s", flush=True)
        # The visibility map and statistics a table in steady state has.
        cursor.execute("VACUUM (ANALYZE) django_idempotency_record")
    print(f"loaded {rows:,} records in {time.monotonic() - started:.0f} s", flush=True)


def pages(days: int) -> list[tuple[str, str, dict[str, str]]]:
    """(what, URL, query) for every page measured."""
    from django.urls import reverse

    from django_idempotency.http.endpoints import idempotent_endpoints
    from django_idempotency.models import IdempotencyRecord
    from django_idempotency.partitions.catalog import utc_today

    changelist = reverse("admin:django_idempotency_idempotencyrecord_changelist")
    middle = IdempotencyRecord.objects.order_by("-id")[10_000:10_001].get()
    day = (utc_today() - timedelta(days=days // 2)).isoformat()
    listed = [
        ("changelist", {}),
        ("changelist, page 200", {"p": "200"}),
        ("search: a stored key", {"q": middle.key}),
        ("search: an unknown key", {"q": str(uuid.uuid4())}),
        ("created: last hour", {"created": "1h"}),
        ("created: last 24 hours", {"created": "24h"}),
        (f"created: {day}", {"created": day}),
        ("response: 2xx", {"response": "2xx"}),
        ("response: 3xx (1 in 1000)", {"response": "3xx"}),
        ("response: 4xx", {"response": "4xx"}),
        ("method: POST", {"method": "POST"}),
        ("method: PATCH", {"method": "PATCH"}),
        *((f"endpoint: {e.route}", {"endpoint": e.route}) for e in idempotent_endpoints()),
        (f"{day} + PATCH + 4xx", {"created": day, "method": "PATCH", "response": "4xx"}),
        ("3xx + PATCH (no record has both)", {"response": "3xx", "method": "PATCH"}),
    ]
    detail = reverse("admin:django_idempotency_idempotencyrecord_change", args=[middle.pk])
    return [(what, changelist, query) for what, query in listed] + [("detail", detail, {})]


def measure(repeat: int, days: int, explain: bool) -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    user, _ = get_user_model().objects.get_or_create(
        username="admin-bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client(HTTP_HOST="localhost")
    client.force_login(user)
    header = f"{'page':<40} {'median ms':>10} {'min ms':>8} {'queries':>8} {'in queries ms':>14}"
    print(header + "\n" + "-" * len(header))
    for what, url, query in pages(days):
        response = client.get(url, query)
        if response.status_code != 200:
            raise RuntimeError(f"{what}: {url}?{urlencode(query)} answered {response.status_code}")
        timings = []
        for _ in range(repeat):
            started = time.perf_counter()
            client.get(url, query)
            timings.append((time.perf_counter() - started) * 1000)
        with CaptureQueriesContext(connection) as queries:
            client.get(url, query)
        in_queries = sum(float(q["time"]) for q in queries.captured_queries) * 1000
        print(
            f"{what:<40} {statistics.median(timings):>10.1f} {min(timings):>8.1f} "
            f"{len(queries):>8} {in_queries:>14.1f}",
            flush=True,
        )
        if explain:
            for captured in queries.captured_queries:
                if captured["sql"].startswith("SELECT") and "django_idempotency" in captured["sql"]:
                    with connection.cursor() as cursor:
                        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + captured["sql"])
                        print("\n".join("    " + row[0] for row in cursor.fetchall()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="records (default: 10M)")
    parser.add_argument("--days", type=int, default=10, help="daily partitions (default: 10)")
    parser.add_argument("--repeat", type=int, default=5, help="timed requests per page")
    parser.add_argument("--reload", action="store_true", help="load the records again")
    parser.add_argument(
        "--explain", action="store_true", help="print the plan of each query on the records table"
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from bench.server import database_url

    os.environ["DATABASE_URL"] = database_url(None, name=DATABASE)
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ.pop("DJANGO_DEBUG", None)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    load(args.rows, args.days, args.reload)
    measure(args.repeat, args.days, args.explain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
