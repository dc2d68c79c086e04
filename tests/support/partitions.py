"""The records table's partitions as the tests see them: raw SQL helpers and a sandbox fixture."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections

from django_idempotency.conf import conf
from django_idempotency.partitions import apply, catalog, tables
from django_idempotency.partitions.tables import RECORDS, PartitionedTable

TABLE = RECORDS.table
partition_name = RECORDS.partition_name


def execute(sql: str, params: list[Any] | None = None, using: str = "default") -> list[Any]:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def table_names(table: str = TABLE) -> set[str]:
    """Every table named like a partition of ``table``, attached or not."""
    return set(table_states(table))


def table_states(table: str = TABLE) -> dict[str, tuple[bool, str | None]]:
    """Name: (attached, comment) of every table named like a partition of ``table``."""
    rows = execute(
        "SELECT relname, relispartition, obj_description(oid, 'pg_class') FROM pg_class "
        "WHERE relkind = 'r' AND relname LIKE %s",
        [table.replace("_", r"\_") + r"\_p%"],
    )
    return {name: (attached, comment) for name, attached, comment in rows}


def attach_foreign(name: str, start: datetime, end: datetime) -> None:
    """A partition someone else made: same name pattern, no comment of ours."""
    execute(f'CREATE TABLE "{name}" (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)')
    execute(
        f'ALTER TABLE {TABLE} ATTACH PARTITION "{name}" '
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )


def insert_record(created_at: datetime, ttl: timedelta, key: str = "k") -> None:
    execute(
        f"INSERT INTO {TABLE} (scope, key, method, path, fingerprint, status, created_at, "
        "expires_at) VALUES ('scope', %s, 'POST', '/p', '{}', 1, %s, %s)",
        [key, created_at, created_at + ttl],
    )


def make_partitions(*days: date, table: PartitionedTable = RECORDS) -> list[str]:
    """Our partitions of ``table`` for ``days``, made as maintenance makes them."""
    return [
        table.partition_name(day)
        for day in days
        if apply.create_partition(connection, table, day, retry_for=timedelta(seconds=5))
    ]


def today() -> date:
    """The database's day: the test's frozen one under ``database_clock``."""
    return catalog.database_now(connection).date()


@pytest.fixture
def database_clock(db: None, monkeypatch: pytest.MonkeyPatch) -> datetime:
    """The database's clock, as maintenance, the checks and ``today()`` read it, frozen at
    the instant the test starts, with every registered table's partitions from the day
    before to ``IDEMPOTENCY_PARTITIONS_AHEAD`` days ahead of that instant, as the migration
    makes them.

    The test database was migrated when the session began, and its ``now()`` goes on: a
    test that computed its days on one side of midnight UTC and ran maintenance on the
    other used to find a day more or less to create and drop. Rows the database stamps
    itself still take its real ``now()``, which the partitions made here cover until a
    week after the test started."""
    now = catalog.database_now(connection)
    monkeypatch.setattr(catalog, "database_now", lambda connection: now)
    day = now.date()
    days = [day + timedelta(days=n) for n in range(-1, conf.PARTITIONS_AHEAD + 1)]
    for table in tables.registered():
        if catalog.table_kind(connection, table) == "partitioned":
            make_partitions(*days, table=table)
    return now


def detach_and_drop(*days: date) -> None:
    for day in days:
        execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{partition_name(day)}"')
        execute(f'DROP TABLE "{partition_name(day)}"')


@pytest.fixture
def partition_sandbox(transactional_db: None, database_clock: datetime) -> Iterator[None]:
    """Give back, after a test that commits DDL, the partitions the test started with (the
    database's clock is frozen for the test: ``database_clock``)."""
    before = table_states()
    yield
    for conn in connections.all():
        conn.close()  # a connection left in a transaction would block the DDL below
    execute("SET lock_timeout = '10s'")
    for p in catalog.list_partitions(connection, RECORDS):
        if p.detach_pending:
            execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{p.name}" FINALIZE')
    for name, state in sorted(table_states().items()):
        if before.get(name) != state:
            attached, _ = state
            if attached:
                execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{name}"')
            execute(f'DROP TABLE "{name}"')
    missing = sorted(set(before) - table_names())
    restored = make_partitions(*(d for d in map(RECORDS.partition_day, missing) if d is not None))
    execute("RESET lock_timeout")
    assert sorted(restored) == missing
    assert table_states() == before
