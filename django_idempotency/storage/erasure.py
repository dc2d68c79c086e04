"""Erasure: a principal's records become tombstones (no body, headers, path or principal, a
digest of each), in short batches; the claim finds a tombstone by its principal's digest."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from functools import lru_cache

from django.db import connections, transaction

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord, StoredErrorCount

logger = logging.getLogger("django_idempotency")

# A tombstone's principal: this prefix and the SHA-256 (hex) of the principal, as migration
# 0010's claim computes it. No principal is stored with this prefix (http/identity.py).
TOMBSTONE_PREFIX = "erased:"
# Ids per batch on PostgreSQL: each batch a transaction of a few tens of milliseconds.
BATCH = 50_000

_ERASE = """
UPDATE django_idempotency_record
   SET scope = 'erased:' || encode(sha256(convert_to(scope, 'UTF8')), 'hex'),
       status = 2, method = '', path = '',
       fingerprint = jsonb_build_object(
           'sha256', encode(sha256(convert_to(fingerprint::text, 'UTF8')), 'hex')),
       response_code = NULL, response_headers = NULL, response_body = NULL, body_encoding = ''
 WHERE id >= %s AND id < %s AND scope = %s
"""
_ID_RANGE = "SELECT min(id), max(id) FROM django_idempotency_record"


@lru_cache(maxsize=4096)
def tombstone_scope(principal: str) -> str:
    """The principal of ``principal``'s tombstones (every claim asks: cached)."""
    return TOMBSTONE_PREFIX + hashlib.sha256(principal.encode()).hexdigest()


def erase(using: str, principal: str, *, batch: int) -> int:
    """Turn ``principal``'s finished records (requests' and consumers') into tombstones, one
    transaction per batch; returns how many. Logged, and signalled (``records_erased``).
    Running it again erases nothing more."""
    started = time.monotonic()
    # The principal's count of stored 4xx names it too (rows of a minute or two).
    StoredErrorCount._default_manager.using(using).filter(scope=principal).delete()
    erased = sum(_batches(using, principal, batch))
    # The log names the tombstones' principal, not the erased one.
    logger.info(
        "Erased %d idempotency records of principal %s on %r in %.1fs.",
        erased,
        tombstone_scope(principal),
        using,
        time.monotonic() - started,
    )
    signals.records_erased.send_robust(None, principal=principal, count=erased, using=using)
    return erased


def _batches(using: str, principal: str, batch: int) -> Iterator[int]:
    """Erase in batches of ``batch`` ids on PostgreSQL, ``batch`` records elsewhere, one
    transaction each; yields each batch's count."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        yield from _erase_plain(using, principal, batch)
        return
    # The table has no index on the principal (every claim would pay for it): a batch reads
    # a range of ids through each partition's primary key. Ids grow with time, so a range
    # lies in one partition or two, and each batch holds its rows' locks for milliseconds.
    with connection.cursor() as cursor:
        cursor.execute(_ID_RANGE)
        low, high = cursor.fetchone() or (None, None)
    if low is None or high is None:
        return
    for start in range(low, high + 1, batch):
        with transaction.atomic(using=using), connection.cursor() as cursor:
            cursor.execute(_ERASE, [start, start + batch, principal])
            yield max(cursor.rowcount, 0)


def _erase_plain(using: str, principal: str, batch: int) -> Iterator[int]:
    records = IdempotencyRecord.objects.using(using)
    scope = tombstone_scope(principal)
    mine = records.filter(scope=principal, status=IdempotencyRecord.Status.COMPLETED)
    while True:
        with transaction.atomic(using=using):
            found = list(mine.order_by("pk")[:batch])
            if not found:
                return
            # The unique index on (key, scope): an older tombstone of the same key goes.
            records.filter(scope=scope, key__in=[r.key for r in found]).delete()
            for record in found:
                fingerprint = json.dumps(record.fingerprint, sort_keys=True).encode()
                records.filter(pk=record.pk).update(
                    scope=scope,
                    status=IdempotencyRecord.Status.ERASED,
                    method="",
                    path="",
                    fingerprint={"sha256": hashlib.sha256(fingerprint).hexdigest()},
                    response_code=None,
                    response_headers=None,
                    response_body=None,
                    body_encoding="",
                )
        yield len(found)
