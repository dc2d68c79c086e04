"""Who fills the records table: stored bytes and records per principal for one day, read
from that day's partition alone."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db import connections
from django.db.models import Count, F, Func, IntegerField, Sum, Value
from django.db.models.functions import Coalesce, Length

from django_idempotency.models import IdempotencyRecord


class _StoredSize(Func):
    # The bytes a value takes on disk, compressed or not: what the table keeps.
    function = "pg_column_size"
    output_field = IntegerField()


@dataclass(frozen=True, slots=True)
class Usage:
    """One principal's records made on the day, and the bytes their bodies, headers and
    fingerprints take."""

    principal: str
    records: int
    stored_bytes: int


def usage(using: str, day: date, *, top: int) -> list[Usage]:
    """The ``top`` principals by stored bytes among the records made on ``day`` (UTC)."""
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    # PostgreSQL: the size as stored (TOAST-compressed), read without detoasting a body.
    size = _StoredSize if connections[using].vendor == "postgresql" else Length
    zero = Value(0)
    stored = (
        Coalesce(size("response_body"), zero)
        + Coalesce(size("response_headers"), zero)
        + Coalesce(size("fingerprint"), zero)
    )
    rows = (
        IdempotencyRecord.objects.using(using)
        # The bounds prune the query to the day's partition.
        .filter(created_at__gte=start, created_at__lt=start + timedelta(days=1))
        .values("scope")
        .annotate(records=Count("id"), stored_bytes=Sum(stored))
        .order_by(F("stored_bytes").desc(), "scope")[:top]
    )
    return [Usage(row["scope"], row["records"], row["stored_bytes"] or 0) for row in rows]
