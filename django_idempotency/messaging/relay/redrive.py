"""The redrive: a published message for an exactly-once task whose consumer has no record of
it (the broker lost it) is put back to be published again (``docs/outbox.md``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import router, transaction
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.messaging.destinations import Destinations
from django_idempotency.messaging.outbox import leases
from django_idempotency.messaging.outbox.leases import Message
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from django_idempotency.storage import records

logger = logging.getLogger("django_idempotency.relay")

# How often a running relay looks for rows due a check, at most (and at least twice per
# IDEMPOTENCY_OUTBOX_REDRIVE_AFTER).
CHECK_EVERY = timedelta(seconds=10)
# A consumer's record is made by the database's clock, the message's created_at by the
# app's: the lookup allows for this much skew between the two.
CLOCK_SKEW = timedelta(hours=1)
GIVEN_UP = (
    "No record of its exactly-once consumer after its redrives "
    "(IDEMPOTENCY_OUTBOX_REDRIVE_LIMIT, or the consumer records' retention): a dead letter, "
    "not published again until requeued (manage.py idempotency_outbox requeue)."
)


@dataclass
class RedriveResult:
    """What one pass over the rows due a check found."""

    checked: int = 0
    # Done with: recorded by their consumer (or whose task is no longer exactly-once).
    consumed: int = 0
    republished: list[str] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)


class Redrive:
    """Checks the published messages of one outbox database against their consumers' records."""

    def __init__(self, using: str, destinations: Destinations) -> None:
        self.using = using
        self.destinations = destinations
        # Each destination redrives through its own means (its Celery app's tasks, the Tasks
        # runner's records), whatever the order in which the settings list them.
        self._redriving = [d for d in destinations if d.redrives]
        self.records_using = router.db_for_write(IdempotencyRecord)

    @property
    def after(self) -> timedelta | None:
        """How long after a publish to check; None when the redrive is off (or the relay
        publishes to no destination whose consumers keep records: a Celery app's exactly-once
        tasks, Django Tasks)."""
        if conf.OUTBOX_REDRIVE_LIMIT <= 0 or not self._redriving:
            return None
        return conf.OUTBOX_REDRIVE_AFTER

    @property
    def check_every(self) -> float:
        after = self.after
        if after is None:
            return CHECK_EVERY.total_seconds()
        return min(CHECK_EVERY, after / 2).total_seconds()

    def principal(self, kind: int, name: str, options: dict[str, Any] | None = None) -> str | None:
        """The principal under which the exactly-once consumer of such a message records it,
        asked of the message's own destination; None when no consumer records it."""
        destination = self.destinations.for_row(kind, name, options or {})
        return destination.consumer_principal(kind, name) if destination.redrives else None

    def import_tasks(self) -> None:
        """Let the Celery destinations import the project's task modules, once, before a
        running relay's first pass (the redrive asks their apps about the tasks)."""
        if self.after is None:
            return
        for destination in self._redriving:
            destination.import_tasks()

    def to_check(self, messages: Iterable[Message]) -> list[str]:
        """The ids, among ``messages`` just published, whose consumer record is to be checked."""
        if self.after is None:
            return []
        return [m.id for m in messages if self.principal(m.kind, m.name, m.options) is not None]

    def run_pass(self, limit: int) -> RedriveResult:
        """Check up to ``limit`` rows that are due, oldest check first; put back for
        publishing those whose consumer has no record of them."""
        result = RedriveResult()
        with transaction.atomic(using=self.using):
            due = leases.due_for_check(self.using, limit)
            if not due:
                return result
            result.checked = len(due)
            principals = {row.pk: self.principal(row.kind, row.name, row.options) for row in due}
            recorded = self._recorded(due, principals)
            now = timezone.now()
            done, again = [], []
            for row in due:
                principal = principals[row.pk]
                if principal is None or (principal, str(row.pk)) in recorded:
                    done.append(row.pk)
                elif row.redrives >= conf.OUTBOX_REDRIVE_LIMIT or (
                    row.created_at < now - conf.CONSUMER_TTL
                ):
                    # Past the limit, or so old that the record may have expired: no more.
                    result.given_up.append(str(row.pk))
                else:
                    again.append(row.pk)
            result.consumed = len(done)
            leases.checked(self.using, done)
            if result.given_up:
                leases.bury(self.using, result.given_up, error=GIVEN_UP)
            if again:
                leases.publish_again(
                    self.using,
                    again,
                    error=f"Published, and no record of its exactly-once consumer by "
                    f"{now.isoformat(timespec='seconds')}: published again.",
                )
                result.republished = [str(pk) for pk in again]
        self._log(result)
        if result.republished:
            signals.outbox_redriven.send_robust(Redrive, ids=result.republished, using=self.using)
        return result

    def _recorded(
        self, due: list[OutboxMessage], principals: dict[Any, str | None]
    ) -> set[tuple[str, str]]:
        """The (principal, message id) pairs, among ``due``, that have a consumer record."""
        wanted = [row for row in due if principals[row.pk] is not None]
        if not wanted:
            return set()
        return records.recorded(
            self.records_using,
            principals={principal for row in wanted if (principal := principals[row.pk])},
            keys=[str(row.pk) for row in wanted],
            since=min(row.created_at for row in wanted) - CLOCK_SKEW,
        )

    def _log(self, result: RedriveResult) -> None:
        if result.republished:
            logger.warning(
                "%d published outbox messages have no record of their exactly-once consumer "
                "%s after publishing; they are published again with the same task ids "
                "(the broker lost them, or they are still queued): %s",
                len(result.republished),
                self.after,
                _some(result.republished),
            )
        if result.given_up:
            logger.error(
                "%d outbox messages were published again up to %d times and their "
                "exactly-once consumer never recorded them (it fails for good, or it lost "
                "them); they are dead letters now, published again only when requeued: %s",
                len(result.given_up),
                conf.OUTBOX_REDRIVE_LIMIT,
                _some(result.given_up),
            )


def _some(ids: list[str], shown: int = 10) -> str:
    return ", ".join(ids[:shown]) + (" ..." if len(ids) > shown else "")
