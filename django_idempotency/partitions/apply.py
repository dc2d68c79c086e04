"""Partition DDL: create one partition, detach and drop one, finish a pending detach.

Every statement that takes a lock runs with a short ``lock_timeout`` and is retried with
backoff, so a live request queues behind it for a moment at most. A partition is made by
``CREATE TABLE … LIKE`` then ``ATTACH PARTITION`` (SHARE UPDATE EXCLUSIVE on the parent)
rather than ``PARTITION OF`` (ACCESS EXCLUSIVE). Old partitions leave by ``DETACH
PARTITION … CONCURRENTLY`` then ``DROP TABLE``: a plain ``DETACH`` or a ``DROP`` of an
attached partition locks the parent exclusively, queues behind every open transaction,
and stalls every claim behind it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date, timedelta
from functools import partial
from typing import TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import conf
from django_idempotency.db import sqlstate
from django_idempotency.partitions.catalog import (
    DROPPING_COMMENT,
    PARTITION_COMMENT,
    Partition,
    day_bounds,
)
from django_idempotency.partitions.tables import PartitionedTable

logger = logging.getLogger("django_idempotency.partitions")

# Serialises everyone who creates partitions, whatever the table.
CREATE_LOCK = "django_idempotency.create_partition"
# lock_not_available (lock_timeout) and deadlock_detected: try again a little later.
RETRYABLE = frozenset({"55P03", "40P01"})
FIRST_RETRY_DELAY = 0.05
MAX_RETRY_DELAY = 2.0

T = TypeVar("T")


class PartitionConflict(Exception):
    """A table of a partition's name exists but is not what we expect; it is left alone."""


def retrying(action: Callable[[], T], *, what: str, retry_for: timedelta) -> T:
    """Run ``action`` again, with growing pauses, while it fails for want of a lock."""
    deadline = time.monotonic() + retry_for.total_seconds()
    delay = FIRST_RETRY_DELAY
    attempt = 1
    while True:
        try:
            return action()
        except DatabaseError as exc:
            if sqlstate(exc) not in RETRYABLE or time.monotonic() + delay > deadline:
                raise
            logger.debug("%s: attempt %d got no lock (%s); retrying", what, attempt, exc)
        # Jitter, so that two waiting sessions do not retry in lockstep.
        time.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, MAX_RETRY_DELAY)
        attempt += 1


def _timeout_setting(timeout: timedelta) -> str:
    return f"{max(1, round(timeout.total_seconds() * 1000))}ms"


@contextmanager
def lock_timeout(connection: BaseDatabaseWrapper, timeout: timedelta) -> Iterator[None]:
    """Set the session's ``lock_timeout`` for the block (autocommit), then restore it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, false)",
            [_timeout_setting(timeout)],
        )
        (previous, _) = cursor.fetchone()
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, false)", [previous])


def in_autocommit(connection: BaseDatabaseWrapper, func: Callable[[BaseDatabaseWrapper], T]) -> T:
    """Run ``func`` on ``connection`` if it is in autocommit, else on a fresh connection to
    the same database in a short-lived thread.

    Inside the caller's transaction, DDL would commit or roll back with it and hold its
    locks until then, and ``DETACH … CONCURRENTLY`` refuses to run at all.
    """
    if not connection.in_atomic_block and connection.get_autocommit():
        return func(connection)
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        own = connections[connection.alias]
        try:
            outcome.append(func(own))
        except BaseException as exc:
            failure.append(exc)
        finally:
            own.close()

    thread = threading.Thread(target=run, name="django_idempotency-ddl")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


def create_partition_statements(table: PartitionedTable, day: date) -> list[str]:
    name = table.partition_name(day)
    start, end = day_bounds(day)
    # Made on the empty table before it is attached: instant, and never attached without.
    indexes = [
        sql.format(partition=f'"{name}"', index_prefix=name) for sql in table.partition_indexes
    ]
    return [
        f'CREATE TABLE IF NOT EXISTS "{name}" '
        f'(LIKE "{table.table}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
        f"INCLUDING COMPRESSION)",
        *indexes,
        f'ALTER TABLE "{table.table}" ATTACH PARTITION "{name}" '
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')",
        f"COMMENT ON TABLE \"{name}\" IS '{PARTITION_COMMENT}'",
    ]


def create_partition(
    connection: BaseDatabaseWrapper, table: PartitionedTable, day: date, *, retry_for: timedelta
) -> bool:
    """Create and attach ``table``'s partition for ``day`` in one short transaction,
    unless it exists; the only way the package creates a partition.

    Returns whether it was created. Raises ``PartitionConflict`` if a table of that name
    exists but is not a partition of ``table``.
    """
    return retrying(
        partial(_create_partition, connection, table, day),
        what=f"create {table.partition_name(day)}",
        retry_for=retry_for,
    )


def _create_partition(connection: BaseDatabaseWrapper, table: PartitionedTable, day: date) -> bool:
    name = table.partition_name(day)
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('lock_timeout', %s, true), "
            "pg_advisory_xact_lock(hashtextextended(%s, 0))",
            [_timeout_setting(conf.DDL_LOCK_TIMEOUT), CREATE_LOCK],
        )
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_inherits "
            "WHERE inhrelid = c.oid AND inhparent = to_regclass(%s)) "
            "FROM pg_class c WHERE c.oid = to_regclass(%s)",
            [table.table, connection.ops.quote_name(name)],
        )
        row = cursor.fetchone()
        if row is not None:
            if row[0]:
                return False
            raise PartitionConflict(f"{name} exists but is not a partition of {table.table}")
        for statement in create_partition_statements(table, day):
            cursor.execute(statement)
    return True


def _execute(connection: BaseDatabaseWrapper, sql: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql)


def _detach(connection: BaseDatabaseWrapper, table: PartitionedTable, name: str) -> None:
    """Detach ``name`` concurrently, or finish a detach that was interrupted."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT inhdetachpending FROM pg_inherits "
            "WHERE inhrelid = to_regclass(%s) AND inhparent = to_regclass(%s)",
            [connection.ops.quote_name(name), table.table],
        )
        row = cursor.fetchone()
    if row is None:
        return  # already detached
    # A lock timeout while CONCURRENTLY waits for older transactions leaves the partition
    # "detach pending": invisible to new queries, and FINALIZE completes it.
    how = "FINALIZE" if row[0] else "CONCURRENTLY"
    qn = connection.ops.quote_name
    _execute(connection, f"ALTER TABLE {qn(table.table)} DETACH PARTITION {qn(name)} {how}")


def _drop_detached(connection: BaseDatabaseWrapper, name: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relispartition, obj_description(oid, 'pg_class') FROM pg_class "
            "WHERE oid = to_regclass(%s)",
            [connection.ops.quote_name(name)],
        )
        row = cursor.fetchone()
    if row is None:
        return
    if row[0] or row[1] != DROPPING_COMMENT:
        raise PartitionConflict(f"{name} changed while being dropped; left alone")
    _execute(connection, f"DROP TABLE {connection.ops.quote_name(name)}")


def finalize_detach(
    connection: BaseDatabaseWrapper,
    table: PartitionedTable,
    partition: Partition,
    *,
    retry_for: timedelta,
) -> None:
    """Complete a detach left pending. Needs autocommit and a session ``lock_timeout``."""
    retrying(
        partial(_detach, connection, table, partition.name),
        what=f"finalize detach of {partition.name}",
        retry_for=retry_for,
    )


def drop_partition(
    connection: BaseDatabaseWrapper,
    table: PartitionedTable,
    partition: Partition,
    *,
    retry_for: timedelta,
) -> None:
    """Mark, detach concurrently, then drop ``partition``; the only way the package drops
    one.

    Needs autocommit (``DETACH … CONCURRENTLY`` refuses a transaction block) and a session
    ``lock_timeout`` (``lock_timeout()``), so no step makes requests queue for long.
    """
    name = partition.name
    qn = connection.ops.quote_name
    if partition.comment != DROPPING_COMMENT:
        retrying(
            partial(_execute, connection, f"COMMENT ON TABLE {qn(name)} IS '{DROPPING_COMMENT}'"),
            what=f"mark {name}",
            retry_for=retry_for,
        )
    retrying(partial(_detach, connection, table, name), what=f"detach {name}", retry_for=retry_for)
    retrying(partial(_drop_detached, connection, name), what=f"drop {name}", retry_for=retry_for)
