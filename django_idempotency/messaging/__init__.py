"""The exactly-once chain beside the request side: ``outbox`` writes, ``relay`` publishes
(``leases``, ``publishing``, ``redrive``), ``consumers`` run once, ``downstream`` keys."""

from __future__ import annotations

from django_idempotency.messaging.downstream import OutsideUnitOfWork, derive_key
from django_idempotency.messaging.outbox import (
    NotInTransaction,
    OutboxError,
    enqueue_event,
    enqueue_task,
)

# ExactlyOnceTask is not listed: it needs Celery, an optional extra (messaging.consumers).
__all__ = [
    "NotInTransaction",
    "OutboxError",
    "OutsideUnitOfWork",
    "derive_key",
    "enqueue_event",
    "enqueue_task",
]
