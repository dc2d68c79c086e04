"""Partition maintenance: the plain function behind ``manage.py idempotency_partitions`` and
the Celery task ``django_idempotency.maintain_partitions``.

On PostgreSQL it plans, then applies: finish pending detaches, create the partitions
missing up to ``IDEMPOTENCY_PARTITIONS_AHEAD`` days ahead, detach and drop our partitions
past retention. Elsewhere (or on a table that is not partitioned) it deletes expired
records in batches, one short transaction per batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import DatabaseError, connections, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from django_idempotency import partitions
from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord

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
    """What a maintenance run found and did."""

    using: str
    dry_run: bool
    partitioned: bool
    skipped: bool = False
    plan: partitions.Plan | None = None
    finalized: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    deleted: int = 0
    future_partitions: int | None = None
    errors: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        if self.skipped:
            return [f"{self.using}: another maintenance run holds the lock; skipped"]
        if not self.partitioned:
            verb = "would delete" if self.dry_run else "deleted"
            lines = [f"{self.using}: table not partitioned; {verb} {self.deleted} expired records"]
        elif self.dry_run:
            assert self.plan is not None
            lines = [f"{self.using}: plan (dry run, nothing changed)", *self.plan.lines()]
        else:
            lines = [
                f"{self.using}: finalized {len(self.finalized)}, created {len(self.created)}, "
                f"dropped {len(self.dropped)} partitions",
                *(f"  finalized {name}" for name in self.finalized),
                *(f"  created {name}" for name in self.created),
                *(f"  dropped {name}" for name in self.dropped),
            ]
        if self.future_partitions is not None:
            lines.append(f"{self.using}: {self.future_partitions} future partitions")
        lines += [f"{self.using}: error: {error}" for error in self.errors]
        return lines

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for a Celery result backend."""
        result = asdict(self)
        result["plan"] = self.plan.lines() if self.plan else None
        return result


def maintain(
    using: str | None = None,
    *,
    dry_run: bool = False,
    drop: bool | None = None,
    now: datetime | None = None,
    retry_for: timedelta = RETRY_FOR,
) -> Report:
    """Create upcoming partitions and drop expired ones; elsewhere delete expired records.

    ``drop=None`` follows ``IDEMPOTENCY_DROP_PARTITIONS``. Raises ``MaintenanceFailed``
    if any step failed, after doing all the others.
    """
    using = using or router.db_for_write(IdempotencyRecord)
    connection = connections[using]
    drop = conf.DROP_PARTITIONS if drop is None else drop
    kind = partitions.table_kind(connection) if connection.vendor == "postgresql" else "plain"
    if kind is None:
        report = Report(using, dry_run, partitioned=True)
        report.errors.append(f"{partitions.TABLE} does not exist; run migrate")
    elif kind == "plain":
        report = Report(using, dry_run, partitioned=False)
        report.deleted = delete_expired(using, now=now, dry_run=dry_run)
    else:
        report = partitions.in_autocommit(
            connection,
            lambda own: _maintain_partitions(own, dry_run, drop, now, retry_for),
        )
    if report.errors:
        raise MaintenanceFailed("; ".join(report.errors), report)
    return report


def _maintain_partitions(
    connection: BaseDatabaseWrapper,
    dry_run: bool,
    drop: bool,
    now: datetime | None,
    retry_for: timedelta,
) -> Report:
    report = Report(connection.alias, dry_run, partitioned=True)
    if dry_run:
        report.plan = _plan(connection, drop, now)
        report.future_partitions = report.plan.future_after
        return report
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
        return report
    try:
        report.plan = _plan(connection, drop, now)
        with partitions.lock_timeout(connection, conf.DDL_LOCK_TIMEOUT):
            _apply(connection, report.plan, report, retry_for)
        found = partitions.list_partitions(connection)
        report.future_partitions = len(partitions.future_partitions(found, report.plan.now))
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [MAINTENANCE_LOCK])
    partitions.announce(report.created, report.dropped, connection.alias)
    if report.future_partitions < 2:
        logger.error(
            "Only %d future partitions of %s exist on %s: claims fail once the last one is "
            "past. Check that `manage.py idempotency_partitions` (or the Celery task "
            "django_idempotency.maintain_partitions) runs and succeeds.",
            report.future_partitions,
            partitions.TABLE,
            connection.alias,
        )
    return report


def _plan(connection: BaseDatabaseWrapper, drop: bool, now: datetime | None) -> partitions.Plan:
    return partitions.make_plan(
        partitions.list_partitions(connection),
        now=now or partitions.database_now(connection),
        ahead=conf.PARTITIONS_AHEAD,
        keep_for=conf.MAX_TTL + conf.EXPIRED_WINDOW + conf.PARTITION_GRACE,
        drop=drop,
    )


def _apply(
    connection: BaseDatabaseWrapper,
    plan: partitions.Plan,
    report: Report,
    retry_for: timedelta,
) -> None:
    """Each step on its own: one that fails is reported and the others still run."""
    for partition in plan.finalize:
        finalize = partial(partitions.finalize_detach, connection, partition, retry_for=retry_for)
        if _step(report, f"finalize detach of {partition.name}", finalize):
            report.finalized.append(partition.name)
    for day in plan.create:
        name = partitions.partition_name(day)
        if _step(
            report,
            f"create {name}",
            partial(partitions.create_partition, connection, day, retry_for=retry_for),
        ):
            report.created.append(name)
            logger.info("Created partition %s on %s", name, connection.alias)
    for partition in plan.drop:
        drop = partial(partitions.drop_partition, connection, partition, retry_for=retry_for)
        if _step(report, f"drop {partition.name}", drop):
            report.dropped.append(partition.name)
            logger.info("Dropped partition %s on %s", partition.name, connection.alias)


def _step(report: Report, what: str, action: Callable[[], bool | None]) -> bool:
    """Run one step; False if it failed (logged and reported) or found nothing to do."""
    try:
        result = action()
    except (DatabaseError, partitions.PartitionConflict) as exc:
        logger.error("Partition maintenance on %s: %s failed: %s", report.using, what, exc)
        report.errors.append(f"{what}: {exc}")
        return False
    return result is not False


def delete_expired(using: str, *, now: datetime | None = None, dry_run: bool = False) -> int:
    """Delete records past their gone window in id batches, one transaction per batch.

    For databases without partitions. Returns how many were (or would be) deleted.
    """
    cutoff = (now or timezone.now()) - conf.EXPIRED_WINDOW
    expired = IdempotencyRecord.objects.using(using).filter(expires_at__lt=cutoff)
    if dry_run:
        return expired.count()
    batch = max(1, conf.DELETE_BATCH_SIZE)
    deleted = 0
    while True:
        # Short transactions: a long DELETE would hold row locks and bloat a WAL burst.
        with transaction.atomic(using=using):
            ids = list(expired.order_by("id").values_list("id", flat=True)[:batch])
            if not ids:
                return deleted
            deleted += IdempotencyRecord.objects.using(using).filter(id__in=ids).delete()[0]
