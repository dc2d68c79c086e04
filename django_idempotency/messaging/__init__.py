"""The exactly-once chain beside the request side: ``outbox`` writes, ``relay`` publishes
(``leases``, ``publishing``, ``redrive``), ``consumers`` run once, ``downstream`` keys;
``cdc`` writes events that leave by change data capture (``publication`` is its setup)."""

from __future__ import annotations

from django_idempotency.messaging.cdc import emit_event
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
    "emit_event",
    "enqueue_event",
    "enqueue_task",
]
