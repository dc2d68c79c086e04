"""The exactly-once chain, beside the request side and on the same storage.

Who writes: ``outbox/`` puts a message in the caller's transaction (``enqueue_task``,
``enqueue_event``; Celery's ``OutboxTask`` in ``outbox/celery.py``, Django's Tasks backend
``OutboxBackend`` in ``outbox/tasks.py``); ``cdc/`` writes events that leave by change data
capture instead (``emit_event``; ``cdc/publication.py`` sets up PostgreSQL's side).

Who relays: ``relay/`` claims committed rows (``outbox/leases``, every statement on the
outbox table), hands each to its destination, marks what was published, beats
(``heartbeats``) and publishes again what a consumer lost (``redrive``). ``destinations/``
sends, each beside its transport: Celery (``celery``, ``celery_broker``), NATS JetStream
(``nats``), Django's Tasks (``tasks``).

Who consumes: ``consumers/`` runs each message once through one core (``exactly_once``), for
Celery (``ExactlyOnceTask``), NATS (``NatsConsumer``) and Django's Tasks (``deliver``).

Shared by all three: ``tracing`` (one trace from the request to the consumer),
``downstream`` (``derive_key``), ``tasks_framework`` (Django's Tasks, built in or the
backport), ``routing`` (the names of destinations) and ``nats_client`` (nats-py's settings and
loop, for the NATS destination and the NATS consumer alike). Imports point down in the order
relay, destinations, consumers, outbox (``pyproject.toml``'s import contracts).

``outbox_task``, ``task_backend``, ``task_runner``, ``nats_consumer`` and ``exactly_once`` are
the first import paths of what moved into the sub-wings; settings and queued jobs name them.
"""

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
