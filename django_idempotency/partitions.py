"""Partition DDL for the records table on PostgreSQL: naming, listing, planning, creating,
dropping.

Every statement that takes a lock runs with a short ``lock_timeout`` and is retried with
backoff, so a live request queues behind it for a moment at most. Old partitions leave by
``DETACH PARTITION … CONCURRENTLY`` then ``DROP TABLE``: a plain ``DETACH`` or a ``DROP``
of an attached partition locks the parent exclusively, queues behind every open
transaction, and stalls every claim behind it.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import partial
from typing import TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency import signals
from django_idempotency.conf import conf

logger = logging.getLogger("django_idempotency.partitions")

TABLE = "django_idempotency_record"
# Set on every partition we create; only partitions carrying it are ever dropped.
PARTITION_COMMENT = "django_idempotency:auto"
# Set just before we detach a partition to drop it, so that a table left detached by a run
# that died before its DROP is told apart from one an operator detached to keep.
DROPPING_COMMENT = "django_idempotency:auto (dropping)"
NAME_PATTERN = re.compile(rf"^{TABLE}_p(\d{{8}})$")
# Serialises everyone who creates partitions: maintenance runs and the request path.
CREATE_LOCK = "django_idempotency.create_partition"
# lock_not_available (lock_timeout) and deadlock_detected: try again a little later.
RETRYABLE = frozenset({"55P03", "40P01"})
FIRST_RETRY_DELAY = 0.05
MAX_RETRY_DELAY = 2.0
# The request path waits at most this long for a partition it has to create itself.
REQUEST_RETRY_FOR = timedelta(seconds=2)

T = TypeVar("T")


class PartitionConflict(Exception):
    """A table of a partition's name exists but is not what we expect; it is left alone."""


def partition_name(day: date) -> str:
    return f"{TABLE}_p{day:%Y%m%d}"


def partition_day(name: str) -> date | None:
    match = NAME_PATTERN.match(name)
    if match is None:
        return None
    try:
        return datetime.strptime(match[1], "%Y%m%d").date()
    except ValueError:
        return None


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
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
    return datetime.now(UTC).date()


# Listing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    """A partition of the records table, or a table we detached and have yet to drop.

    ``lower``/``upper`` are None for MINVALUE/MAXVALUE (and both for DEFAULT).
    """

    name: str
    lower: datetime | None
    upper: datetime | None
    comment: str | None
    attached: bool = True
    detach_pending: bool = False
    default: bool = False

    @property
    def ours(self) -> bool:
        return self.comment in (PARTITION_COMMENT, DROPPING_COMMENT)

    @property
    def live(self) -> bool:
        """Attached and not being detached: new records may land in it."""
        return self.attached and not self.detach_pending

    def covers(self, start: datetime, end: datetime) -> bool:
        if not self.live or self.default:
            return False
        return (self.lower is None or self.lower < end) and (
            self.upper is None or self.upper > start
        )


# Bounds are read back through the session's own DateStyle and TimeZone (whatever they
# are) and handed over as epoch seconds, so no time zone can shift them on the way.
LIST_PARTITIONS = r"""
SELECT c.relname, i.inhdetachpending, pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT',
       CASE WHEN left(m[1], 1) = '''' THEN extract(epoch FROM btrim(m[1], '''')::timestamptz) END,
       CASE WHEN left(m[2], 1) = '''' THEN extract(epoch FROM btrim(m[2], '''')::timestamptz) END,
       obj_description(c.oid, 'pg_class'), true
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  LEFT JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                 '^FOR VALUES FROM \((.*)\) TO \((.*)\)$') AS m ON true
 WHERE i.inhparent = to_regclass(%s)
UNION ALL
SELECT c.relname, false, false, NULL, NULL, obj_description(c.oid, 'pg_class'), false
  FROM pg_class c
 WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass(%s))
   AND c.relkind = 'r' AND NOT c.relispartition
   AND obj_description(c.oid, 'pg_class') = %s
 ORDER BY 1
"""


def _utc(epoch: Decimal | float | None) -> datetime | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(float(epoch), UTC)


def list_partitions(connection: BaseDatabaseWrapper) -> list[Partition]:
    """The table's partitions, and the tables we detached to drop and have not dropped."""
    with connection.cursor() as cursor:
        cursor.execute(LIST_PARTITIONS, [TABLE, TABLE, DROPPING_COMMENT])
        rows = cursor.fetchall()
    found = []
    for name, pending, default, lower, upper, comment, attached in rows:
        if not attached:
            # Detached: the bounds are gone with the partition; the name still tells the day.
            day = partition_day(name)
            lower, upper = day_bounds(day) if day else (None, None)
        else:
            lower, upper = _utc(lower), _utc(upper)
        found.append(Partition(name, lower, upper, comment, attached, bool(pending), bool(default)))
    return found


def table_kind(connection: BaseDatabaseWrapper) -> str | None:
    """``"partitioned"``, ``"plain"``, or None if the table does not exist (yet)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [TABLE])
        row = cursor.fetchone()
    if row is None:
        return None
    return "partitioned" if row[0] == "p" else "plain"


def database_now(connection: BaseDatabaseWrapper) -> datetime:
    """The database's clock, which stamps ``created_at``; the app server's may differ."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM now())")
        (epoch,) = cursor.fetchone()
    now = _utc(epoch)
    assert now is not None
    return now


def future_partitions(found: Sequence[Partition], now: datetime) -> list[Partition]:
    """Live partitions that start tomorrow (UTC) or later: how far ahead we are covered."""
    tomorrow = day_bounds(now.astimezone(UTC).date())[1]
    return [
        p for p in found if p.live and not p.default and p.lower is not None and p.lower >= tomorrow
    ]


# Planning -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What a maintenance run does: finish pending detaches, create, drop; and what it keeps."""

    now: datetime
    cutoff: datetime
    finalize: tuple[Partition, ...]
    create: tuple[date, ...]
    drop: tuple[Partition, ...]
    keep: tuple[tuple[Partition, str], ...]
    # Live partitions starting tomorrow or later once the plan is applied.
    future_after: int = 0
    notes: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.finalize or self.create or self.drop)

    def lines(self) -> list[str]:
        lines = [
            f"now {_fmt(self.now)}; partitions that ended at or before {_fmt(self.cutoff)} "
            f"may be dropped"
        ]
        lines += [f"  finalize detach  {p.name}" for p in self.finalize]
        for day in self.create:
            start, end = day_bounds(day)
            lines.append(f"  create           {partition_name(day)}  [{_fmt(start)}, {_fmt(end)})")
        for p in self.drop:
            how = "drop" if not p.attached else "detach and drop"
            lines.append(f"  {how:<16} {p.name}  (ended {_fmt(p.upper)})")
        lines += [f"  keep             {p.name}  ({why})" for p, why in self.keep]
        lines += [f"  note: {note}" for note in self.notes]
        if self.empty:
            lines.append("  nothing to do")
        return lines


def _fmt(moment: datetime | None) -> str:
    if moment is None:
        return "unbounded"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def make_plan(
    found: Sequence[Partition],
    *,
    now: datetime,
    ahead: int,
    keep_for: timedelta,
    drop: bool,
) -> Plan:
    """Decide, without touching the database, what a maintenance run at ``now`` does.

    Creates the partitions missing from today to today + ``ahead`` (UTC days). Drops a
    partition only if we created it, it is no DEFAULT partition, and its upper bound is at
    or before ``now - keep_for``: every record in it was created before that bound, so it
    is past its longest retention and its gone window by then.
    """
    now = now.astimezone(UTC)
    today = now.date()
    today_start, tomorrow = day_bounds(today)
    cutoff = now - keep_for
    has_default = any(p.default and p.attached for p in found)
    notes = []
    if has_default:
        notes.append(
            "a DEFAULT partition exists: PostgreSQL refuses DETACH … CONCURRENTLY while it "
            "does, so no attached partition is dropped"
        )
    create = tuple(
        day
        for day in (today + timedelta(days=n) for n in range(max(ahead, 0) + 1))
        if not any(p.covers(*day_bounds(day)) for p in found)
    )
    finalize, drops, keep = [], [], []
    for p in found:
        if p.default:
            reason = "DEFAULT partition, never dropped"
        elif not p.ours:
            reason = "not created by django-idempotency"
        elif p.upper is None or p.upper > cutoff or p.upper > today_start:
            reason = _kept_because(p, now, tomorrow, keep_for)
        elif not drop:
            reason = "past retention; dropping is off"
        elif has_default and p.live:
            reason = "past retention; a DEFAULT partition blocks dropping"
        else:
            drops.append(p)
            continue
        if p.detach_pending:
            finalize.append(p)
        keep.append((p, reason))
    future_after = len(future_partitions(found, now)) + sum(day > today for day in create)
    return Plan(
        now,
        cutoff,
        tuple(finalize),
        create,
        tuple(drops),
        tuple(keep),
        future_after,
        tuple(notes),
    )


def _kept_because(p: Partition, now: datetime, tomorrow: datetime, keep_for: timedelta) -> str:
    if p.lower is not None and p.lower >= tomorrow:
        return "future"
    if p.upper is None or p.upper > now:
        return "current"
    return f"holds records until {_fmt(p.upper + keep_for)}"


# Applying -----------------------------------------------------------------------------


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (psycopg 3 or psycopg2) that Django wrapped."""
    cause = exc.__cause__
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return str(code) if code else None


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


def create_partition(connection: BaseDatabaseWrapper, day: date, *, retry_for: timedelta) -> bool:
    """Create and attach ``day``'s partition in one short transaction, unless it exists.

    Returns whether it was created. Raises ``PartitionConflict`` if a table of that name
    exists but is not a partition of the records table.
    """
    return retrying(
        partial(_create_partition, connection, day),
        what=f"create {partition_name(day)}",
        retry_for=retry_for,
    )


def _create_partition(connection: BaseDatabaseWrapper, day: date) -> bool:
    name = partition_name(day)
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
            [TABLE, connection.ops.quote_name(name)],
        )
        row = cursor.fetchone()
        if row is not None:
            if row[0]:
                return False
            raise PartitionConflict(f"{name} exists but is not a partition of {TABLE}")
        for statement in create_partition_statements(day):
            cursor.execute(statement)
    return True


def _execute(connection: BaseDatabaseWrapper, sql: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql)


def _detach(connection: BaseDatabaseWrapper, name: str) -> None:
    """Detach ``name`` concurrently, or finish a detach that was interrupted."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT inhdetachpending FROM pg_inherits "
            "WHERE inhrelid = to_regclass(%s) AND inhparent = to_regclass(%s)",
            [connection.ops.quote_name(name), TABLE],
        )
        row = cursor.fetchone()
    if row is None:
        return  # already detached
    # A lock timeout while CONCURRENTLY waits for older transactions leaves the partition
    # "detach pending": invisible to new queries, and FINALIZE completes it.
    how = "FINALIZE" if row[0] else "CONCURRENTLY"
    qn = connection.ops.quote_name
    _execute(connection, f"ALTER TABLE {qn(TABLE)} DETACH PARTITION {qn(name)} {how}")


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
    connection: BaseDatabaseWrapper, partition: Partition, *, retry_for: timedelta
) -> None:
    """Complete a detach left pending. Needs autocommit and a session ``lock_timeout``."""
    retrying(
        lambda: _detach(connection, partition.name),
        what=f"finalize detach of {partition.name}",
        retry_for=retry_for,
    )


def drop_partition(
    connection: BaseDatabaseWrapper, partition: Partition, *, retry_for: timedelta
) -> None:
    """Mark, detach concurrently, then drop ``partition``.

    Needs autocommit (``DETACH … CONCURRENTLY`` refuses a transaction block) and a session
    ``lock_timeout`` (``lock_timeout()``), so no step makes requests queue for long.
    """
    name = partition.name
    qn = connection.ops.quote_name
    if partition.comment != DROPPING_COMMENT:
        retrying(
            lambda: _execute(connection, f"COMMENT ON TABLE {qn(name)} IS '{DROPPING_COMMENT}'"),
            what=f"mark {name}",
            retry_for=retry_for,
        )
    retrying(lambda: _detach(connection, name), what=f"detach {name}", retry_for=retry_for)
    retrying(lambda: _drop_detached(connection, name), what=f"drop {name}", retry_for=retry_for)


def announce(created: list[str], dropped: list[str], using: str) -> None:
    """Send ``partitions_created`` / ``partitions_dropped``, with ``send_robust``: a failing
    receiver is logged by Django and fails nothing."""
    if created:
        signals.partitions_created.send_robust(sender=None, names=created, using=using)
    if dropped:
        signals.partitions_dropped.send_robust(sender=None, names=dropped, using=using)


def ensure_current_partition(connection: BaseDatabaseWrapper) -> list[str]:
    """Create today's and tomorrow's partitions (UTC) if they are missing.

    The request path's way out when maintenance has not run for days. Works inside a
    transaction too (on a separate connection). Returns the names created.
    """
    created = in_autocommit(connection, _ensure_current_partition)
    if created:
        logger.error(
            "Created %s from the request path: partition maintenance is not running "
            "(schedule `manage.py idempotency_partitions` or the Celery task)",
            ", ".join(created),
        )
        announce(created, [], connection.alias)
    return created


def _ensure_current_partition(connection: BaseDatabaseWrapper) -> list[str]:
    found = list_partitions(connection)
    today = database_now(connection).date()
    created = []
    for day in (today, today + timedelta(days=1)):
        if any(p.covers(*day_bounds(day)) for p in found):
            continue
        if create_partition(connection, day, retry_for=REQUEST_RETRY_FOR):
            created.append(partition_name(day))
    return created
