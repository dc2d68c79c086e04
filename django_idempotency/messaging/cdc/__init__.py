"""Events for change data capture: a row in the caller's transaction, in the shape Debezium's
outbox event router reads, which leaves the database through the write-ahead log (a
publication and a logical replication slot) instead of through the relay."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.db import connections

from django_idempotency.conf import conf
from django_idempotency.messaging.outbox import (
    OutboxError,
    dumps,
    in_transaction,
    named_message_id,
)
from django_idempotency.models import OutboxEvent
from django_idempotency.partitions.tables import PartitionedTable
from django_idempotency.storage.riders import write

TABLE = "django_idempotency_outbox_event"

INSERT = f"""
INSERT INTO {TABLE} (id, created_at, aggregatetype, aggregateid, type, payload)
VALUES (%s, %s, %s, %s, %s, %s::jsonb)
"""

# The columns are varchar(255), as Debezium's documented outbox table.
MAX_LENGTH = 255

# Partition maintenance keeps the event table too: partitions ahead, and whole days dropped
# once past IDEMPOTENCY_CDC_RETENTION. Nothing is kept back for a replication slot: a slot
# holds the write-ahead log its rows were decoded from, so a drop never takes an event
# from one (docs/change-data-capture.md, "Retention").
EVENTS = PartitionedTable(
    table=TABLE,
    column="created_at",
    model="django_idempotency.OutboxEvent",
    keep_for=lambda: conf.CDC_RETENTION,
)


def _text(value: object, what: str) -> str:
    if isinstance(value, uuid.UUID | int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value:
        raise OutboxError(f"The event's {what} must be a non-empty str, not {value!r}.")
    if len(value) > MAX_LENGTH:
        raise OutboxError(
            f"The event's {what} is {len(value)} characters long; the column holds {MAX_LENGTH}."
        )
    return value


def cloudevent(
    event_id: uuid.UUID,
    created_at: datetime,
    aggregate_type: str,
    aggregate_id: str,
    event_type: str,
    payload: Any,
) -> dict[str, Any]:
    """``payload`` as the data of a CloudEvents 1.0 JSON document (structured mode)."""
    return {
        "specversion": "1.0",
        "id": str(event_id),
        "source": f"{conf.CDC_CLOUDEVENTS_SOURCE.rstrip('/')}/{aggregate_type}",
        "type": event_type,
        "subject": aggregate_id,
        # RFC 3339 in UTC, to the millisecond the message id encodes.
        "time": created_at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "datacontenttype": "application/json",
        "data": payload,
    }


def emit_event(
    aggregate_type: str,
    aggregate_id: str | int | uuid.UUID,
    event_type: str,
    payload: Any,
    *,
    cloudevents: bool | None = None,
    using: str | None = None,
) -> str:
    """Write an event to the event table in the current transaction; return its id.

    A change data capture tool reads it from the write-ahead log once, and only if, that
    transaction commits. ``aggregate_type`` names the topic (Debezium's default routing),
    ``aggregate_id`` is the message key (one aggregate's events stay in order),
    ``payload`` must be JSON; None writes a null payload (a tombstone, if the router is told
    to emit one). ``cloudevents=None`` follows ``IDEMPOTENCY_CDC_CLOUDEVENTS``: True wraps
    the payload in a CloudEvents 1.0 envelope. Raises ``NotInTransaction`` outside
    ``transaction.atomic()`` and ``OutboxError`` for an argument the table cannot hold.
    """
    aggregate_type = _text(aggregate_type, "aggregate type")
    aggregate_id = _text(aggregate_id, "aggregate id")
    event_type = _text(event_type, "type")
    alias = in_transaction(using, OutboxEvent, "emit_event()")
    event_id, created_at = named_message_id(alias, "cdc")
    if conf.CDC_CLOUDEVENTS if cloudevents is None else cloudevents:
        payload = cloudevent(
            event_id, created_at, aggregate_type, aggregate_id, event_type, payload
        )
    document = None if payload is None else dumps(payload, "event's payload")
    if connections[alias].vendor != "postgresql":
        OutboxEvent.objects.using(alias).create(
            id=event_id,
            created_at=created_at,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            event_type=event_type,
            payload=payload,
        )
        return str(event_id)
    row: list[Any] = [event_id, created_at, aggregate_type, aggregate_id, event_type, document]
    # In a protected view or an exactly-once task, the row travels with the record's store.
    write(alias, INSERT, row)
    return str(event_id)
