"""Every query the engine makes on the records table; the only writer of new records."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord

WON, FOUND, EXPIRED, BUSY = "won", "found", "expired", "busy"
# SQLSTATE for a row that no partition accepts ("no partition of relation ... found").
_NO_PARTITION = "23514"


class PartitionMissing(Exception):
    """The claim's insert found no partition for today: maintenance has not run."""


@dataclass(frozen=True)
class Record:
    id: int
    created_at: datetime
    expires_at: datetime
    method: str
    path: str
    fingerprint: dict[str, str]
    status: int
    response_code: int | None
    response_headers: list[list[str]] | None
    response_body: bytes | None
    body_encoding: str


@dataclass(frozen=True)
class Claim:
    outcome: str  # WON, FOUND, EXPIRED or BUSY
    record: Record | None


def _jsonb(value: Any) -> Any:
    # psycopg hands jsonb back decoded; other drivers may give text.
    return json.loads(value) if isinstance(value, str) else value


def claim(
    using: str,
    *,
    scope: str,
    key: str,
    method: str,
    path: str,
    fingerprint: dict[str, str],
    ttl: timedelta,
    window: timedelta,
    gone: timedelta,
    wait: timedelta,
    now: datetime | None = None,
) -> Claim:
    """Claim (scope, key) inside the caller's transaction, or find who holds it.

    Waits up to ``wait`` for an in-flight holder to finish. Must run inside ``atomic``.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        return _claim_plain(using, scope, key, method, path, fingerprint, ttl, gone, now)
    wait_ms = max(0, int(wait.total_seconds() * 1000))
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT * FROM django_idempotency_claim(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                [scope, key, method, path, json.dumps(fingerprint), ttl, window, gone, wait_ms, now],
            )
            row = cursor.fetchone()
    except IntegrityError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == _NO_PARTITION:
            raise PartitionMissing(str(exc)) from exc
        raise
    assert row is not None
    outcome, *fields = row
    if outcome == BUSY:
        return Claim(BUSY, None)
    fields[5] = _jsonb(fields[5])
    fields[8] = _jsonb(fields[8])
    if fields[9] is not None:
        fields[9] = bytes(fields[9])
    return Claim(outcome, Record(*fields))


def _claim_plain(
    using: str,
    scope: str,
    key: str,
    method: str,
    path: str,
    fingerprint: dict[str, str],
    ttl: timedelta,
    gone: timedelta,
    now: datetime | None,
) -> Claim:
    """Other databases: a plain table with a unique (scope, key) index. An expired row is
    taken over in place; a concurrent claimer loses on the unique index."""
    now = now or timezone.now()
    records = IdempotencyRecord.objects.using(using)
    existing = records.filter(scope=scope, key=key).first()
    if existing is not None:
        if existing.expires_at + gone > now:
            outcome = FOUND if existing.expires_at > now else EXPIRED
            return Claim(outcome, _record(existing))
        existing.delete()
    try:
        with transaction.atomic(using=using):
            created = records.create(
                scope=scope, key=key, method=method, path=path, fingerprint=fingerprint,
                created_at=now, expires_at=now + ttl,
            )
    except IntegrityError:
        return Claim(BUSY, None)
    return Claim(WON, _record(created))


def _record(obj: IdempotencyRecord) -> Record:
    body = obj.response_body
    return Record(
        id=obj.pk, created_at=obj.created_at, expires_at=obj.expires_at, method=obj.method,
        path=obj.path, fingerprint=obj.fingerprint, status=obj.status,
        response_code=obj.response_code, response_headers=obj.response_headers,
        response_body=bytes(body) if body is not None else None,
        body_encoding=obj.body_encoding,
    )


def _one(using: str, record: Record) -> Any:
    # Filtering on created_at too prunes the statement to the record's own partition.
    return IdempotencyRecord.objects.using(using).filter(
        pk=record.id, created_at=record.created_at
    )


def complete(
    using: str,
    record: Record,
    *,
    code: int,
    headers: list[list[str]],
    body: bytes,
    encoding: str,
) -> None:
    _one(using, record).update(
        status=IdempotencyRecord.Status.COMPLETED, response_code=code,
        response_headers=headers, response_body=body, body_encoding=encoding,
    )


def release(using: str, record: Record) -> None:
    """Remove a claim whose outcome is not stored, so the key is free again."""
    _one(using, record).delete()



def create_current_partition(using: str) -> bool:
    """Create today's partition from the request path; False when that cannot be done here
    (inside the request's own transaction under ATOMIC_REQUESTS)."""
    from django_idempotency import partitions

    connection = connections[using]
    if connection.in_atomic_block:
        return False
    partitions.ensure_current_partition(connection)
    return True
