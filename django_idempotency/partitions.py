"""Partition DDL for the records table on PostgreSQL: naming, creating, planning, dropping."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from datetime import timezone as dt_timezone

from django.db.backends.base.base import BaseDatabaseWrapper

TABLE = "django_idempotency_record"
# Set on every partition we create; only partitions carrying it are ever dropped.
PARTITION_COMMENT = "django_idempotency:auto"


def partition_name(day: date) -> str:
    return f"{TABLE}_p{day:%Y%m%d}"


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, day.day, tzinfo=dt_timezone.utc)
    return start, start + timedelta(days=1)


def create_partition_statements(day: date) -> list[str]:
    """CREATE + ATTACH (SHARE UPDATE EXCLUSIVE on the parent) rather than PARTITION OF
    (ACCESS EXCLUSIVE), so creating a partition never queues behind live requests."""
    name = partition_name(day)
    start, end = day_bounds(day)
    return [
        f'CREATE TABLE IF NOT EXISTS "{name}" '
        f'(LIKE "{TABLE}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
        f'ALTER TABLE "{TABLE}" ATTACH PARTITION "{name}" '
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')",
        f"COMMENT ON TABLE \"{name}\" IS '{PARTITION_COMMENT}'",
    ]


def attached_partitions(connection: BaseDatabaseWrapper) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE p.relname = %s AND p.relnamespace = c.relnamespace "
            "AND pg_table_is_visible(p.oid)",
            [TABLE],
        )
        return {row[0] for row in cursor.fetchall()}


def create_partitions(connection: BaseDatabaseWrapper, days: list[date]) -> list[str]:
    """Create the missing daily partitions for ``days``; return the names created."""
    existing = attached_partitions(connection)
    created = []
    with connection.cursor() as cursor:
        for day in days:
            if partition_name(day) in existing:
                continue
            for statement in create_partition_statements(day):
                cursor.execute(statement)
            created.append(partition_name(day))
    return created


def utc_today() -> date:
    return datetime.now(dt_timezone.utc).date()
