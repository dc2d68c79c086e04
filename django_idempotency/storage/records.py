"""Every query the engine makes on the records table; the only writer of new records."""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord

WON, FOUND, EXPIRED, BUSY, NO_PARTITION = "won", "found", "expired", "busy", "nopartition"


class PartitionMissing(Exception):
    """No partition accepts today's records: maintenance has not run for days."""


@dataclass(frozen=True)
class Record:
    """A stored record, as the claim found it."""

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
class Pending:
    """A key we hold: what ``complete`` will write when the response is known."""

    scope: str
    key: str
    method: str
    path: str
    fingerprint: dict[str, str]
    created_at: datetime
    expires_at: datetime
    # Set on the fallback path only, where the claim itself inserted the row.
    id: int | None = None


@dataclass(frozen=True)
class Attempt:
    """What a request asks to claim."""

    scope: str
    key: str
    method: str
    path: str
    fingerprint: dict[str, str]
    ttl: timedelta

    def pending(self, created_at: datetime, id: int | None = None) -> Pending:
        return Pending(
            scope=self.scope,
            key=self.key,
            method=self.method,
            path=self.path,
            fingerprint=self.fingerprint,
            created_at=created_at,
            expires_at=created_at + self.ttl,
            id=id,
        )


@dataclass(frozen=True)
class Claim:
    outcome: str  # WON, FOUND, EXPIRED or BUSY
    record: Record | None = None
    pending: Pending | None = None


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
    """Claim (scope, key) inside the caller's transaction, or find the record that holds it.

    Waits up to ``wait`` for an in-flight holder to finish. Must run inside ``atomic``;
    the claim lasts until that transaction ends.
    """
    attempt = Attempt(scope, key, method, path, fingerprint, ttl)
    connection = connections[using]
    if connection.vendor != "postgresql":
        return _claim_plain(using, attempt, gone, now)
    wait_ms = max(0, int(wait.total_seconds() * 1000))
    # psycopg adapts timedelta to interval; django-stubs' parameter types leave it out.
    params: list[Any] = [scope, key, window, gone, wait_ms, now]
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM django_idempotency_claim(%s, %s, %s, %s, %s, %s)", params)
        row = cursor.fetchone()
    assert row is not None
    outcome, *fields = row
    if outcome == NO_PARTITION:
        raise PartitionMissing(f"No partition for records created at {fields[1]}")
    if outcome == BUSY:
        return Claim(BUSY)
    if outcome == WON:
        return Claim(WON, pending=attempt.pending(fields[1]))
    fields[5] = _jsonb(fields[5])
    fields[8] = _jsonb(fields[8])
    if fields[9] is not None:
        fields[9] = bytes(fields[9])
    return Claim(outcome, record=Record(*fields))


def _claim_plain(using: str, attempt: Attempt, gone: timedelta, now: datetime | None) -> Claim:
    """Other databases: a plain table with a unique (scope, key) index. The claim inserts
    an in-progress row; a concurrent claimer loses on the index; an expired row is
    replaced."""
    now = now or timezone.now()
    records = IdempotencyRecord.objects.using(using)
    existing = records.filter(scope=attempt.scope, key=attempt.key).first()
    if existing is not None:
        if existing.expires_at + gone > now:
            outcome = FOUND if existing.expires_at > now else EXPIRED
            return Claim(outcome, record=_record(existing))
        existing.delete()
    pending = attempt.pending(now)
    try:
        with transaction.atomic(using=using):
            created = records.create(**_identity(pending))
    except IntegrityError:
        return Claim(BUSY)
    return Claim(WON, pending=replace(pending, id=created.pk))


def _identity(pending: Pending) -> dict[str, Any]:
    """The record's columns that the claim decides (all but the id and the response)."""
    return {name: value for name, value in asdict(pending).items() if name != "id"}


def _record(obj: IdempotencyRecord) -> Record:
    body = obj.response_body
    return Record(
        id=obj.pk,
        created_at=obj.created_at,
        expires_at=obj.expires_at,
        method=obj.method,
        path=obj.path,
        fingerprint=obj.fingerprint,
        status=obj.status,
        response_code=obj.response_code,
        response_headers=obj.response_headers,
        response_body=bytes(body) if body is not None else None,
        body_encoding=obj.body_encoding,
    )


# The one write on the hot path, in plain SQL: the ORM's create() costs several times
# more Python per request and asks for the id back, which nobody needs.
_INSERT_COMPLETED = (
    "INSERT INTO django_idempotency_record (scope, key, method, path, fingerprint, "
    "created_at, expires_at, status, response_code, response_headers, response_body, "
    "body_encoding) VALUES (%s, %s, %s, %s, %s, %s, %s, 1, %s, %s, %s, %s)"
)


ZLIB = "zlib"


def encode_body(body: bytes) -> tuple[bytes, str]:
    """The body as stored, and how: compressed when it is large and that pays."""
    if len(body) >= conf.COMPRESS_MIN_BYTES:
        compressed = zlib.compress(body, 6)
        if len(compressed) < len(body):
            return compressed, ZLIB
    return body, ""


def decode_body(stored: bytes | memoryview | None, encoding: str) -> bytes:
    body = bytes(stored or b"")
    return zlib.decompress(body) if encoding == ZLIB else body


def complete(
    using: str,
    pending: Pending,
    *,
    code: int,
    headers: list[list[str]],
    body: bytes,
) -> None:
    """Write the finished record, in the claim's transaction."""
    body, encoding = encode_body(body)
    if pending.id is not None:
        IdempotencyRecord.objects.using(using).filter(pk=pending.id).update(
            status=IdempotencyRecord.Status.COMPLETED,
            response_code=code,
            response_headers=headers,
            response_body=body,
            body_encoding=encoding,
        )
        return
    with connections[using].cursor() as cursor:
        cursor.execute(
            _INSERT_COMPLETED,
            [
                pending.scope,
                pending.key,
                pending.method,
                pending.path,
                json.dumps(pending.fingerprint),
                pending.created_at,
                pending.expires_at,
                code,
                json.dumps(headers),
                body,
                encoding,
            ],
        )


def create_current_partition(using: str) -> None:
    """Create today's partition from the request path (maintenance has not run)."""
    from django_idempotency import partitions

    partitions.ensure_current_partition(connections[using])
