"""What exists: a table's partitions with their bounds and comments, the table's kind, and
the database's clock. Reads only."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.partitions.tables import PartitionedTable

# Set on every partition we create; only partitions carrying it are ever dropped.
PARTITION_COMMENT = "django_idempotency:auto"
# Set just before we detach a partition to drop it, so that a table left detached by a run
# that died before its DROP is told apart from one an operator detached to keep.
DROPPING_COMMENT = "django_idempotency:auto (dropping)"


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start, start + timedelta(days=1)


def utc_today() -> date:
    return datetime.now(UTC).date()


@dataclass(frozen=True)
class Partition:
    """A partition of a table, or a table we detached and have yet to drop.

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
        """Attached and not being detached: new rows may land in it."""
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
   AND c.relname LIKE %s
"""


def _utc(epoch: Decimal | float | None) -> datetime | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(float(epoch), UTC)


def _like_prefix(table: str) -> str:
    escaped = table.replace("\\", "\\\\").replace("_", r"\_").replace("%", r"\%")
    return escaped + r"\_p%"


def list_partitions(connection: BaseDatabaseWrapper, table: PartitionedTable) -> list[Partition]:
    """``table``'s partitions, and the tables we detached from it to drop and have not
    dropped."""
    with connection.cursor() as cursor:
        cursor.execute(
            LIST_PARTITIONS,
            [table.table, table.table, DROPPING_COMMENT, _like_prefix(table.table)],
        )
        rows = cursor.fetchall()
    found = []
    for name, pending, default, lower, upper, comment, attached in rows:
        if not attached:
            # Detached: the bounds are gone with the partition; the name still tells the day.
            day = table.partition_day(name)
            if day is None:
                continue
            lower, upper = day_bounds(day)
        else:
            lower, upper = _utc(lower), _utc(upper)
        found.append(Partition(name, lower, upper, comment, attached, bool(pending), bool(default)))
    return sorted(found, key=lambda p: p.name)


def table_kind(connection: BaseDatabaseWrapper, table: PartitionedTable) -> str | None:
    """``"partitioned"``, ``"plain"``, or None if the table does not exist (yet)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [table.table])
        row = cursor.fetchone()
    if row is None:
        return None
    return "partitioned" if row[0] == "p" else "plain"


def database_now(connection: BaseDatabaseWrapper) -> datetime:
    """The database's clock, which stamps new rows; the app server's may differ."""
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


def holds(found: Sequence[Partition], moment: datetime) -> bool:
    """Whether a live partition (DEFAULT included) takes a row stamped ``moment``."""
    if any(p.live and p.default for p in found):
        return True
    return any(p.covers(moment, moment + timedelta(microseconds=1)) for p in found)


def covered_until(found: Iterable[Partition], now: datetime) -> datetime:
    """The first moment from ``now`` on that no live partition holds (``now`` itself when
    none holds it). A DEFAULT partition is not counted: we never create one."""
    spans = sorted(
        (p.lower or datetime.min.replace(tzinfo=UTC), p.upper)
        for p in found
        if p.live and not p.default and p.upper is not None
    )
    reached = now
    for lower, upper in spans:
        if lower > reached:
            break
        reached = max(reached, upper)
    return reached
