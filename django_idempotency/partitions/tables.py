"""Which tables partition maintenance keeps: one ``PartitionedTable`` per table, listed by
dotted path in ``TABLES``.

Another module of the package adds its table by declaring a ``PartitionedTable`` in its
own module and appending that declaration's dotted path to ``TABLES``: maintenance then
creates its partitions ahead and drops them once past retention, in the same run as the
records' partitions, and the ``W101`` family of checks watches it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta

from django.apps import apps
from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Q
from django.utils.module_loading import import_string

from django_idempotency.conf import conf


@dataclass(frozen=True)
class PartitionedTable:
    """A table partitioned by UTC day on a ``timestamptz`` column.

    ``keep_for`` is read at each run: a partition is dropped once its upper bound is at
    least that far in the past (and only if it carries our comment). ``model``
    ("app_label.ModelName") routes the table to its database (without one, every database
    maintenance runs on) and, where the table is not partitioned (SQLite), deletes the rows
    that ``expired`` selects in batches; by default, rows whose ``column`` is older than
    ``keep_for``. ``keep_partition(connection, name)``, asked before a partition past
    retention is dropped, returns a reason to keep it anyway, or None.
    """

    table: str
    column: str
    keep_for: Callable[[], timedelta]
    model: str | None = None
    expired: Callable[[datetime], Q] | None = None
    keep_partition: Callable[[BaseDatabaseWrapper, str], str | None] | None = None
    partition_indexes: tuple[str, ...] = ()
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pattern", re.compile(rf"^{re.escape(self.table)}_p(\d{{8}})$"))

    def partition_name(self, day: date) -> str:
        return f"{self.table}_p{day:%Y%m%d}"

    def partition_day(self, name: str) -> date | None:
        """The day a partition of ours is named for, or None for any other name."""
        match = self._pattern.match(name)
        if match is None:
            return None
        try:
            return datetime.strptime(match[1], "%Y%m%d").date()
        except ValueError:
            return None

    def model_class(self) -> type[models.Model] | None:
        return None if self.model is None else apps.get_model(self.model)

    def expired_rows(self, now: datetime) -> Q:
        if self.expired is not None:
            return self.expired(now)
        return Q(**{f"{self.column}__lt": now - self.keep_for()})


def _records_keep_for() -> timedelta:
    # The longest a view or an exactly-once consumer may keep a record, its 410 window,
    # and a margin for clocks.
    longest = max(conf.MAX_TTL, conf.CONSUMER_TTL)
    return longest + conf.EXPIRED_WINDOW + conf.PARTITION_GRACE


def _records_expired(now: datetime) -> Q:
    return Q(expires_at__lt=now - conf.EXPIRED_WINDOW)


RECORDS = PartitionedTable(
    table="django_idempotency_record",
    column="created_at",
    model="django_idempotency.IdempotencyRecord",
    keep_for=_records_keep_for,
    expired=_records_expired,
    # Within a partition, one execution per generation of a key: the database refuses a
    # second one that the lock failed to stop (the migration makes it on its own partitions).
    partition_indexes=(
        'CREATE UNIQUE INDEX IF NOT EXISTS "{index_prefix}_one_execution" '
        "ON {partition} (key, scope, generation)",
    ),
)

# Dotted paths, resolved when maintenance runs, so that this module imports none of the
# modules that declare tables. Append yours; keep RECORDS first.
TABLES: tuple[str, ...] = (
    "django_idempotency.partitions.tables.RECORDS",
    "django_idempotency.messaging.outbox.OUTBOX",
    "django_idempotency.messaging.cdc.EVENTS",
)


def registered() -> tuple[PartitionedTable, ...]:
    """The tables that maintenance keeps, in ``TABLES`` order."""
    found = []
    for path in TABLES:
        table = import_string(path)
        if not isinstance(table, PartitionedTable):
            raise TypeError(f"{path} is a {type(table).__name__}, not a PartitionedTable")
        found.append(table)
    return tuple(found)
