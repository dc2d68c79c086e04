"""Re-encryption under the first key, a batch at a time: records not sealed under it, read in
id order with their rows locked (rows locked by others are left for the next run)."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import router, transaction

from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import bodies, sealing
from django_idempotency.storage.records import as_record


@dataclass(slots=True)
class Pass:
    """What one batch did; ``last_id`` is where the next one starts (None: nothing left)."""

    last_id: int | None = None
    from_plain: int = 0
    from_other_keys: int = 0
    # (record id, why) of records that no listed key opens: left as they are.
    unreadable: list[tuple[int, str]] = field(default_factory=list)


def reseal_batch(
    ring: sealing.Keyring,
    *,
    using: str | None,
    after: int,
    size: int,
    min_bytes: int,
    codec: str | None = None,
) -> Pass:
    """Seal under ``ring``'s first key up to ``size`` records with an id above ``after``, in
    one short transaction. Requests never wait for it: they lock keys, not rows."""
    using = using or router.db_for_write(IdempotencyRecord)
    done = Pass()
    target = sealing.SEALED + ring.sealing.id
    with transaction.atomic(using=using):
        rows = list(
            IdempotencyRecord.objects.using(using)
            .filter(
                id__gt=after,
                status=IdempotencyRecord.Status.COMPLETED,
                response_body__isnull=False,
            )
            .exclude(body_encoding__startswith=target)
            .order_by("id")
            # A row being erased or deleted meanwhile is skipped, never written back.
            .select_for_update(skip_locked=True)[:size]
        )
        for row in rows:
            done.last_id = row.id
            resealed = _resealed(ring, row, using, min_bytes, codec)
            if isinstance(resealed, str):
                done.unreadable.append((row.id, resealed))
                continue
            if sealing.sealed_under(row.body_encoding) is None:
                done.from_plain += 1
            else:
                done.from_other_keys += 1
            body, encoding = resealed
            IdempotencyRecord.objects.using(using).filter(
                pk=row.id, created_at=row.created_at
            ).update(response_body=body, response_headers=None, body_encoding=encoding)
    return done


def _resealed(
    ring: sealing.Keyring, row: IdempotencyRecord, using: str, min_bytes: int, codec: str | None
) -> tuple[bytes, str] | str:
    """The row's new body and encoding, or why it cannot be opened."""
    code = row.response_code or 200
    try:
        plain = sealing.opened(as_record(row), ring, scope=row.scope, key=row.key, plain=True)
    except sealing.Unreadable as exc:
        return str(exc)
    body, encoding = plain.response_body, plain.body_encoding
    if not encoding:
        body, encoding = bodies.encode_body(using, body, min_bytes, sealed=True, codec=codec)
    return sealing.seal(
        ring,
        scope=row.scope,
        key=row.key,
        status=code,
        headers=plain.response_headers,
        body=body,
        encoding=encoding,
    )
