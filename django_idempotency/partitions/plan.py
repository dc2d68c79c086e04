"""What a maintenance run does, decided from the catalog and the clock alone: which days
to create, which of our partitions to drop, which pending detaches to finish, and why the
rest stay. ``--dry-run`` prints it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django_idempotency.partitions.catalog import Partition, day_bounds, future_partitions
from django_idempotency.partitions.tables import PartitionedTable


@dataclass(frozen=True)
class TablePlan:
    """One table's part of a run: finish pending detaches, create, drop; and what it keeps."""

    table: PartitionedTable
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
            f"{self.table.table}: now {_fmt(self.now)}; partitions that ended at or before "
            f"{_fmt(self.cutoff)} may be dropped"
        ]
        lines += [f"  finalize detach  {p.name}" for p in self.finalize]
        for day in self.create:
            start, end = day_bounds(day)
            lines.append(
                f"  create           {self.table.partition_name(day)}  [{_fmt(start)}, {_fmt(end)})"
            )
        for p in self.drop:
            how = "drop" if not p.attached else "detach and drop"
            lines.append(f"  {how:<16} {p.name}  (ended {_fmt(p.upper)})")
        lines += [f"  keep             {p.name}  ({why})" for p, why in self.keep]
        lines += [f"  note: {note}" for note in self.notes]
        if self.empty:
            lines.append("  nothing to do")
        return lines


@dataclass(frozen=True)
class Plan:
    """A run's plan: one ``TablePlan`` per table, in the order of ``tables.TABLES``."""

    tables: tuple[TablePlan, ...]

    @property
    def empty(self) -> bool:
        return all(plan.empty for plan in self.tables)

    def lines(self) -> list[str]:
        return [line for plan in self.tables for line in plan.lines()]


def _fmt(moment: datetime | None) -> str:
    if moment is None:
        return "unbounded"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def plan_table(
    table: PartitionedTable,
    found: Sequence[Partition],
    *,
    now: datetime,
    ahead: int,
    keep_for: timedelta,
    drop: bool,
) -> TablePlan:
    """Decide, without touching the database, what a run at ``now`` does to ``table``.

    Creates the partitions missing from today to today + ``ahead`` (UTC days). Drops a
    partition only if we created it, it is no DEFAULT partition, and its upper bound is at
    or before ``now - keep_for``: every row in it was stamped before that bound, so it is
    past its retention by then.
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
    return TablePlan(
        table,
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
    return f"holds rows until {_fmt(p.upper + keep_for)}"
