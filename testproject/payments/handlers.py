"""The payments API's NATS JetStream handlers, for ``manage.py idempotency_consume_nats
--handler testproject.payments.handlers.post_ledger_entry`` (the nats extra)."""

from __future__ import annotations

from django_idempotency.messaging.nats_consumer import StreamMessage
from testproject.payments import ledger


def post_ledger_entry(message: StreamMessage) -> None:
    """The charge's ledger message routed to NATS (``IDEMPOTENCY_OUTBOX_ROUTES``): the body of
    a task is ``{"args": [...], "kwargs": {...}}``, its ``Nats-Msg-Id`` the outbox message id."""
    body = message.json()
    ledger.post_ledger_entry(message.id, *body["args"], **body["kwargs"])
