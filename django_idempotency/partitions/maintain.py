"""Partition maintenance: the plain function behind ``manage.py idempotency_partitions`` and
the Celery task ``django_idempotency.maintain_partitions``.

For each table in ``tables.TABLES`` on PostgreSQL it plans, then applies: finish pending
detaches, create the partitions missing up to ``IDEMPOTENCY_PARTITIONS_AHEAD`` days ahead,
detach and drop our partitions past the table's retention. Elsewhere (or for a table that
is not partitioned) it deletes expired rows in batches, one short transaction per batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import DatabaseError, connections, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.partitions import apply, catalog
from django_idempotency.partitions.plan import Plan, TablePlan, plan_table
from django_idempotency.partitions.tables import RECORDS, PartitionedTable, registered

logger = logging.getLogger("django_idempotency.partitions")

# Serialises maintenance runs: a second run while one holds it skips.
MAINTENANCE_LOCK = "django_idempotency.maintain_partitions"
# How long one step keeps retrying for its locks, e.g. a detach waiting for a long
# transaction to end. A step still blocked after that is left for the next run.
RETRY_FOR = timedelta(minutes=5)


class MaintenanceFailed(Exception):
    """Some steps failed (the others were done); ``report`` says which."""

    # The message alone is the exception's args, so that Celery can rebuild it from a
    # result backend.
    def __init__(self, message: str, report: Report | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class Report:
    """What a maintenance run found and did, on one database."""

    using: str
    dry_run: bool
    skipped: bool = False
    plan: Plan | None = None
    finalized: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    # Tables that are not partitioned: expired rows deleted (or that a dry run would).
    deleted: dict[str, int] = field(default_factory=dict)
    # Partitioned tables: live partitions from tomorrow (UTC) on, once the run is done.
    future: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def future_partitions(self) -> int | None:
        """The shortest headroom of any table, in days; None if no table is partitioned."""
        return min(self.future.values()) if self.future else None

    def lines(self) -> list[str]:
        lines = []
        verb = "would delete" if self.dry_run else "deleted"
        for table, count in self.deleted.items():
            lines.append(f"{self.using}: {table} not partitioned; {verb} {count} expired rows")
        if self.skipped:
            lines.append(f"{self.using}: another maintenance run holds the lock; skipped")
        elif self.plan is not None and self.dry_run:
            lines += [f"{self.using}: plan (dry run, nothing changed)", *self.plan.lines()]
        elif self.plan is not None:
            lines += [
                f"{self.using}: finalized {len(self.finalized)}, created {len(self.created)}, "
                f"dropped {len(self.dropped)} partitions",
                *(f"  finalized {name}" for name in self.finalized),
                *(f"  created {name}" for name in self.created),
                *(f"  dropped {name}" for name in self.dropped),
            ]
        for table, count in self.future.items():
            lines.append(f"{self.using}: {count} future partitions of {table}")
        lines += [f"{self.using}: error: {error}" for error in self.errors]
        return lines

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for a Celery result backend."""
        result = asdict(self)
        result["plan"] = self.plan.lines() if self.plan else None
        result["future_partitions"] = self.future_partitions
        return result


def maintain(
    using: str | None = None,
    *,
    dry_run: bool = False,
    drop: bool | None = None,
    now: datetime | None = None,
    retry_for: timedelta = RETRY_FOR,
    tables: Sequence[PartitionedTable] | None = None,
) -> Report:
    """Create upcoming partitions and drop expired ones of every registered table;
    elsewhere delete expired rows.

    ``using=None`` is the records' database; a table whose model is routed elsewhere is
    left to a run on its own database. ``drop=None`` follows ``IDEMPOTENCY_DROP_PARTITIONS``;
    ``tables=None`` is ``tables.registered()``. Raises ``MaintenanceFailed`` if any step
    failed, after doing all the others.
    """
    if using is None:
        records = RECORDS.model_class()
        assert records is not None
        using = router.db_for_write(records)
    connection = connections[using]
    drop = conf.DROP_PARTITIONS if drop is None else drop
    report = Report(using, dry_run)
    partitioned = []
    for table in registered() if tables is None else tables:
        model = table.model_class()
        if model is not None and not router.allow_migrate_model(using, model):
            continue
        kind: str | None = "plain"
        if connection.vendor == "postgresql":
            kind = catalog.table_kind(connection, table)
        if kind is None:
            report.errors.append(f"{table.table} does not exist; run migrate")
        elif kind == "plain":
            if model is None:
                report.errors.append(f"{table.table} is not partitioned and names no model")
            else:
                report.deleted[table.table] = delete_expired(table, using, now=now, dry_run=dry_run)
        else:
            partitioned.append(table)
    if partitioned:
        apply.in_autocommit(
            connection,
            lambda own: _maintain_partitions(own, partitioned, report, drop, now, retry_for),
        )
    if report.errors:
        raise MaintenanceFailed("; ".join(report.errors), report)
    return report


def _maintain_partitions(
    connection: BaseDatabaseWrapper,
    tables: Sequence[PartitionedTable],
    report: Report,
    drop: bool,
    now: datetime | None,
    retry_for: timedelta,
) -> None:
    if report.dry_run:
        report.plan = _plan(connection, tables, drop, now)
        report.future = {p.table.table: p.future_after for p in report.plan.tables}
        return
    # A session lock: the run spans many transactions. It goes with the session if the
    # process dies.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [MAINTENANCE_LOCK])
        (locked,) = cursor.fetchone()
    if not locked:
        logger.info(
            "Partition maintenance on %s skipped: another run is in progress", connection.alias
        )
        report.skipped = True
        return
    try:
        report.plan = _plan(connection, tables, drop, now)
        with apply.lock_timeout(connection, conf.DDL_LOCK_TIMEOUT):
            for table_plan in report.plan.tables:
                _apply(connection, table_plan, report, retry_for)
        for table_plan in report.plan.tables:
            found = catalog.list_partitions(connection, table_plan.table)
            future = catalog.future_partitions(found, table_plan.now)
            report.future[table_plan.table.table] = len(future)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [MAINTENANCE_LOCK])
    announce(report.created, report.dropped, connection.alias)
    for table, count in report.future.items():
        if count < 2:
            logger.error(
                "Only %d future partitions of %s exist on %s: writes fail once the last one "
                "is past. Check that `manage.py idempotency_partitions` (or the Celery task "
                "django_idempotency.maintain_partitions) runs and succeeds.",
                count,
                table,
                connection.alias,
            )


def _plan(
    connection: BaseDatabaseWrapper,
    tables: Sequence[PartitionedTable],
    drop: bool,
    now: datetime | None,
) -> Plan:
    now = now or catalog.database_now(connection)
    return Plan(
        tuple(
            _kept_by_table(
                connection,
                plan_table(
                    table,
                    catalog.list_partitions(connection, table),
                    now=now,
                    ahead=conf.PARTITIONS_AHEAD,
                    keep_for=table.keep_for(),
                    drop=drop,
                ),
            )
            for table in tables
        )
    )


def _kept_by_table(connection: BaseDatabaseWrapper, plan: TablePlan) -> TablePlan:
    """Take off the drop list what the table says to keep (the outbox: a partition holding
    an unpublished message), whatever its age."""
    keep_partition = plan.table.keep_partition
    if keep_partition is None or not plan.drop:
        return plan
    drop, keep = [], list(plan.keep)
    for partition in plan.drop:
        reason = keep_partition(connection, partition.name)
        if reason is None:
            drop.append(partition)
        else:
            keep.append((partition, reason))
    return replace(plan, drop=tuple(drop), keep=tuple(keep))


def _apply(
    connection: BaseDatabaseWrapper, plan: TablePlan, report: Report, retry_for: timedelta
) -> None:
    """Each step on its own: one that fails is reported and the others still run."""
    table = plan.table
    for partition in plan.finalize:
        finalize = partial(apply.finalize_detach, connection, table, partition, retry_for=retry_for)
        if _step(report, f"finalize detach of {partition.name}", finalize):
            report.finalized.append(partition.name)
    for day in plan.create:
        name = table.partition_name(day)
        create = partial(apply.create_partition, connection, table, day, retry_for=retry_for)
        if _step(report, f"create {name}", create):
            report.created.append(name)
            logger.info("Created partition %s on %s", name, connection.alias)
    for partition in plan.drop:
        drop = partial(apply.drop_partition, connection, table, partition, retry_for=retry_for)
        if _step(report, f"drop {partition.name}", drop):
            report.dropped.append(partition.name)
            logger.info("Dropped partition %s on %s", partition.name, connection.alias)


def _step(report: Report, what: str, action: Callable[[], bool | None]) -> bool:
    """Run one step; False if it failed (logged and reported) or found nothing to do."""
    try:
        result = action()
    except (DatabaseError, apply.PartitionConflict) as exc:
        logger.error("Partition maintenance on %s: %s failed: %s", report.using, what, exc)
        report.errors.append(f"{what}: {exc}")
        return False
    return result is not False


def announce(created: list[str], dropped: list[str], using: str) -> None:
    """Send ``partitions_created`` / ``partitions_dropped``, with ``send_robust``: a failing
    receiver is logged by Django and fails nothing."""
    if created:
        signals.partitions_created.send_robust(sender=None, names=created, using=using)
    if dropped:
        signals.partitions_dropped.send_robust(sender=None, names=dropped, using=using)


def delete_expired(
    table: PartitionedTable, using: str, *, now: datetime | None = None, dry_run: bool = False
) -> int:
    """Delete ``table``'s expired rows in id batches, one transaction per batch.

    For databases without partitions. Returns how many were (or would be) deleted.
    """
    model = table.model_class()
    assert model is not None
    expired = model._default_manager.using(using).filter(table.expired_rows(now or timezone.now()))
    if dry_run:
        return expired.count()
    batch = max(1, conf.DELETE_BATCH_SIZE)
    deleted = 0
    while True:
        # Short transactions: a long DELETE would hold row locks and bloat a WAL burst.
        with transaction.atomic(using=using):
            ids = list(expired.order_by("pk").values_list("pk", flat=True)[:batch])
            if not ids:
                return deleted
            deleted += model._default_manager.using(using).filter(pk__in=ids).delete()[0]
