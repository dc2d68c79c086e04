"""Who fills the table: ``manage.py idempotency_usage`` ranks one day's principals by stored
bytes, reading that day's partition alone."""

from __future__ import annotations

import os
import re
from datetime import UTC, date, datetime, timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.storage.usage import usage
from tests.factories import IdempotencyRecordFactory

pytestmark = pytest.mark.django_db


def one_instant() -> tuple[datetime, date]:
    """The records' time and its UTC day, taken once: a midnight UTC passed between
    writing the records and asking for a day's usage must not move them to another day."""
    now = timezone.now()
    return now, now.astimezone(UTC).date()


def test_principals_are_ranked_by_stored_bytes_for_the_day_only() -> None:
    now, day = one_instant()
    IdempotencyRecordFactory.create_batch(
        3, scope="tenant:small", response_body=b"x" * 10, created_at=now
    )
    # Random bytes: PostgreSQL stores them as they are (the bytes as stored are counted).
    IdempotencyRecordFactory(scope="tenant:big", response_body=os.urandom(10_240), created_at=now)
    yesterday = now - timedelta(days=1)
    IdempotencyRecordFactory.create_batch(
        5, scope="tenant:yesterday", created_at=yesterday, response_body=b"y" * 100_000
    )

    found = usage("default", day, top=10)

    assert [(row.principal, row.records) for row in found] == [
        ("tenant:big", 1),
        ("tenant:small", 3),
    ]
    assert found[0].stored_bytes > 10_000 > found[1].stored_bytes > 30
    assert usage("default", day, top=1) == found[:1]


def test_the_query_reads_the_days_partition_alone() -> None:
    now, day = one_instant()
    IdempotencyRecordFactory(created_at=now)
    with CaptureQueriesContext(connection) as queries:
        usage("default", day, top=5)
    [sql] = [q["sql"] for q in queries if "django_idempotency_record" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    today = day.strftime("%Y%m%d")
    # "Seq Scan on <partition>", "Index Scan using <its index> on <partition>".
    scanned = set(re.findall(r" on (django_idempotency_record_p\d+)\b", plan))
    assert scanned == {f"django_idempotency_record_p{today}"}, plan


def test_the_command_prints_bytes_records_and_usernames() -> None:
    alice = User.objects.create_user("alice")
    now, day = one_instant()
    IdempotencyRecordFactory.create_batch(2, scope=f"user:{alice.pk}", created_at=now)
    out = StringIO()

    call_command("idempotency_usage", "--day", day.isoformat(), stdout=out)

    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["stored", "bytes"]
    assert lines[1].split()[1] == "2" and lines[1].endswith(f"alice (user:{alice.pk})")
    with pytest.raises(CommandError, match="YYYY-MM-DD"):
        call_command("idempotency_usage", "--day", "yesterday")
