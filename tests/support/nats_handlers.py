"""Handlers for the NATS consumer's tests (``tests/messaging/test_nats_consumer.py``): each
delivery that runs writes one effect row; a message's body may ask, on its first delivery,
for a fault: ``raise``, a SIGKILL in the middle of the handler (``mid``) or right after the
commit, before the acknowledgement (``after_commit``)."""

from __future__ import annotations

import os
import signal

from django.db import connection, transaction

from django_idempotency.messaging.consumers.nats import StreamMessage

TABLE = "test_nats_consumer_effects"


def create_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (message_id text NOT NULL, body text NOT NULL)"
        )


def drop_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")


def effects() -> dict[str, int]:
    """How many effect rows each message id has."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT message_id, count(*) FROM {TABLE} GROUP BY message_id")
        return {message_id: int(count) for message_id, count in cursor.fetchall()}


def record_effect(message: StreamMessage) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} (message_id, body) VALUES (%s, %s)",
            [message.id, message.data.decode()],
        )
    fault = message.json().get("fault") if message.delivered == 1 else None
    if fault == "raise":
        raise RuntimeError("a fault injected in the handler")
    if fault == "mid":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "after_commit":
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
