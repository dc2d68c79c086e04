"""The outbox: a message written as a row in the caller's transaction, published by the relay
(``manage.py idempotency_relay``) once, and only if, that transaction commits."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any, Protocol

from django.db import connections, router
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Max, Model, Q

from django_idempotency.conf import conf
from django_idempotency.messaging import downstream
from django_idempotency.messaging.tracing import TRACE_OPTION, enqueue_context
from django_idempotency.models import OutboxMessage
from django_idempotency.partitions.tables import PartitionedTable
from django_idempotency.storage.riders import write

TABLE = "django_idempotency_outbox"
# The relay LISTENs here; a NOTIFY is delivered only when the sending transaction commits.
CHANNEL = "django_idempotency_outbox"

INSERT_ONLY = f"""
INSERT INTO {TABLE} (id, created_at, kind, name, args, kwargs, payload, options)
VALUES (%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb)
"""
# One statement, one round trip: the row and the wake-up call for the relays.
INSERT = f"""
WITH message AS ({INSERT_ONLY} RETURNING 1)
SELECT pg_notify('{CHANNEL}', '') FROM message
"""

ORDER_SEQUENCE = "django_idempotency_outbox_order"
# The first half of the key's advisory lock (pg_advisory_xact_lock(int, int)): a class of
# the package's own, apart from the application's locks.
ORDER_LOCK_CLASS = 0x1D3A
# A keyed message takes its place only once it holds its key's lock, which it keeps until its
# transaction ends: a later transaction on the key waits for this one to commit (or roll
# back) before it takes a place, so places follow commit order. nextval() is evaluated after
# the lock's row is produced, and is not transactional, so no snapshot or clock is involved.
KEY_LOCK = f"key_lock AS (SELECT pg_advisory_xact_lock({ORDER_LOCK_CLASS}, hashtext(%s)))"
KEYED_ROW = f"""
INSERT INTO {TABLE} (id, created_at, kind, name, args, kwargs, payload, options, ordering_key,
                     ordering_seq)
SELECT %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb, %s,
       nextval('{ORDER_SEQUENCE}')
  FROM key_lock
"""
KEYED_INSERT_ONLY = f"WITH {KEY_LOCK} {KEYED_ROW}"
KEYED_INSERT = f"""
WITH {KEY_LOCK}, message AS ({KEYED_ROW} RETURNING 1)
SELECT pg_notify('{CHANNEL}', '') FROM message
"""
MAX_ORDERING_KEY = 255


# keep_partition() counts this many unpublished rows at most.
UNPUBLISHED_COUNT_LIMIT = 1000


class OutboxError(Exception):
    """A message could not be put in the outbox."""


class NotInTransaction(OutboxError):
    """``enqueue_task()`` or ``enqueue_event()`` ran outside ``transaction.atomic()``."""


class NamedTask(Protocol):
    @property
    def name(self) -> str: ...


_clock_lock = threading.Lock()
_last_stamp = 0  # (milliseconds << 12) | counter of the last id made in this process
_last_micros = 0  # the created_at of the last message with a derived id, in microseconds


def new_message_id() -> tuple[uuid.UUID, datetime]:
    """A UUIDv7 (RFC 9562) and the instant its first 48 bits encode.

    Within a process ids only ever grow: 12 bits count ids made in the same millisecond, and
    a clock stepping back keeps counting on from the last id instead.
    """
    global _last_stamp
    now_ms = time.time_ns() // 1_000_000
    with _clock_lock:
        stamp = max(now_ms << 12, _last_stamp + 1)
        _last_stamp = stamp
    millis, counter = stamp >> 12, stamp & 0xFFF
    random_bits = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (millis << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | random_bits
    return uuid.UUID(int=value), datetime.fromtimestamp(millis / 1000, UTC)


def named_message_id(alias: str, kind: str) -> tuple[uuid.UUID, datetime]:
    """The id of a message (``kind``: "outbox", "cdc") written on ``alias`` now, and its
    ``created_at``: in a keyed unit of work an id derived from the request, so that a run
    again after a lost commit publishes the same id (``downstream.message_id()``); else a
    random UUIDv7."""
    global _last_micros
    derived = downstream.message_id(alias, kind)
    if derived is None:
        return new_message_id()
    # The id says no time, so created_at alone orders a request's messages for the relay:
    # strictly growing within a process, to the microsecond.
    with _clock_lock:
        micros = _last_micros = max(time.time_ns() // 1000, _last_micros + 1)
    return derived, datetime.fromtimestamp(micros // 1_000_000, UTC).replace(
        microsecond=micros % 1_000_000
    )


def task_name(kind: int, name: str) -> str:
    """The Celery task a message calls: its own for a task, the event task for an event."""
    return conf.OUTBOX_EVENT_TASK if kind == OutboxMessage.Kind.EVENT else name


def in_transaction(
    using: str | None,
    model: type[Model] = OutboxMessage,
    calls: str = "enqueue_task() / enqueue_event()",
) -> str:
    """The database ``model``'s row goes to, which must be in a transaction: else
    ``NotInTransaction``, naming ``calls`` (the functions that write it)."""
    alias = using or router.db_for_write(model)
    if not connections[alias].in_atomic_block:
        raise NotInTransaction(
            f"The outbox writes its row in the current transaction on database {alias!r}, and "
            f"there is none: call {calls} inside transaction.atomic(), so that the message "
            "is published if and only if your writes commit. A protected view's POST and "
            "PATCH (its protected methods, with a key or without one) and an exactly-once "
            "task run in one on the database of their records; other methods, other views, "
            "and writes to another database need their own."
        )
    return alias


def dumps(value: object, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise OutboxError(f"The {what} cannot be stored as JSON: {exc}") from exc


def _ordering_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_ORDERING_KEY:
        raise OutboxError(
            f"An ordering key is a non-empty str of at most {MAX_ORDERING_KEY} characters, "
            f"not {key!r}: name the entity whose messages must keep their order, such as "
            '"order:1234".'
        )
    return key


def write_message(
    alias: str,
    kind: OutboxMessage.Kind,
    name: str,
    args: object,
    kwargs: object,
    payload: object,
    options: dict[str, Any],
    ordering_key: str | None = None,
) -> str:
    """Write one message's row on ``alias`` (already checked to be in a transaction), with
    the trace context when tracing is on and its key's place when it has an ordering key;
    return its id. Every way into the outbox writes through here."""
    carrier = enqueue_context()
    if carrier is not None:
        options[TRACE_OPTION] = carrier
    message_id, created_at = named_message_id(alias, "outbox")
    if connections[alias].vendor != "postgresql":
        place = None
        if ordering_key is not None:
            # The database serialises writers (SQLite): the next place is the highest + 1.
            highest = OutboxMessage.objects.using(alias).aggregate(seq=Max("ordering_seq"))
            place = (highest["seq"] or 0) + 1
        OutboxMessage.objects.using(alias).create(
            id=message_id,
            created_at=created_at,
            kind=kind,
            name=name,
            args=args,
            kwargs=kwargs,
            payload=payload,
            options=options,
            ordering_key=ordering_key,
            ordering_seq=place,
        )
        return str(message_id)
    row: list[Any] = [
        message_id,
        created_at,
        int(kind),
        name,
        dumps(args, "task's args"),
        dumps(kwargs, "task's kwargs"),
        None if payload is None else dumps(payload, "event's payload"),
        dumps(options, "publish options"),
    ]
    if ordering_key is None:
        sql = INSERT if conf.OUTBOX_NOTIFY else INSERT_ONLY
    else:
        sql = KEYED_INSERT if conf.OUTBOX_NOTIFY else KEYED_INSERT_ONLY
        row = [ordering_key, *row, ordering_key]
    # In a protected view or an exactly-once task, the row travels with the record's store
    # (a keyed row then takes its key's lock there, just before the commit).
    write(alias, sql, row)
    return str(message_id)


def keep_partition(connection: BaseDatabaseWrapper, partition: str) -> str | None:
    """Why partition maintenance must not drop an outbox partition, or None if it may.

    Retention applies to published messages only: a partition that still holds an
    unpublished message (a dead letter too, which waits for an operator) is never dropped,
    however old. Checking before the detach is enough,
    since a published row never becomes unpublished and new rows land in today's partition.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT count(*) FROM (SELECT 1 FROM "{partition}" '
            f"WHERE published_at IS NULL LIMIT {UNPUBLISHED_COUNT_LIMIT}) AS pending"
        )
        (count,) = cursor.fetchone()
    if not count:
        return None
    more = "+" if count >= UNPUBLISHED_COUNT_LIMIT else ""
    return f"holds {count}{more} unpublished message{'' if count == 1 else 's'}"


def _outbox_expired(now: datetime) -> Q:
    # Without partitions (SQLite): published messages past retention; never unpublished ones.
    return Q(published_at__isnull=False, created_at__lt=now - conf.OUTBOX_RETENTION)


# Partition maintenance keeps the outbox too: partitions ahead, and published messages
# dropped with their day once it is past IDEMPOTENCY_OUTBOX_RETENTION.
OUTBOX = PartitionedTable(
    table=TABLE,
    column="created_at",
    model="django_idempotency.OutboxMessage",
    keep_for=lambda: conf.OUTBOX_RETENTION,
    expired=_outbox_expired,
    keep_partition=keep_partition,
)


def enqueue_task(
    task_or_name: NamedTask | str,
    args: tuple[Any, ...] | list[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    queue: str | None = None,
    countdown: float | None = None,
    ordering_key: str | None = None,
    using: str | None = None,
) -> str:
    """Put a Celery task call in the outbox, in the current transaction; return its message id.

    The message id is the task id the worker sees, on every publish attempt: derived from the
    request in a protected view's keyed request or an exactly-once task (the same again if the
    request runs again after a lost commit), else a random UUIDv7 string.
    Arguments must be JSON. ``countdown`` counts from the enqueue, not from the publish.
    Messages with the same ``ordering_key`` are published in the order their transactions
    committed, each only once the one before is published (``docs/outbox.md``).
    """
    name = task_or_name if isinstance(task_or_name, str) else task_or_name.name
    options: dict[str, Any] = {}
    if queue is not None:
        options["queue"] = queue
    if countdown is not None:
        options["countdown"] = float(countdown)
    key = _ordering_key(ordering_key)
    alias = in_transaction(using)
    return write_message(
        alias, OutboxMessage.Kind.TASK, name, list(args), kwargs or {}, None, options, key
    )


def enqueue_event(
    topic: str,
    payload: dict[str, Any],
    *,
    ordering_key: str | None = None,
    using: str | None = None,
) -> str:
    """Put an event in the outbox, in the current transaction; return its message id.

    It is published as a call of the Celery task named by ``IDEMPOTENCY_OUTBOX_EVENT_TASK``
    with the arguments ``(topic, payload)`` and the message id as task id (or to the
    destination its route names). ``ordering_key`` as for ``enqueue_task()``.
    """
    key = _ordering_key(ordering_key)
    alias = in_transaction(using)
    return write_message(alias, OutboxMessage.Kind.EVENT, topic, [], {}, payload, {}, key)
