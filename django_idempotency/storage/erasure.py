"""Erasure: a principal's records become tombstones (no body, headers, path or principal, a
keyed digest of each), in short batches; the claim finds a tombstone by its principal's
digest."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from django.db import connections, transaction

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import digests

logger = logging.getLogger("django_idempotency")

# A tombstone's principal: this prefix and a keyed digest (storage/digests.py) of the SHA-256
# (hex) of the principal; migration 0017 keyed the plain "erased:<SHA-256>" of older ones
# the same way. No principal is stored with this prefix (http/identity.py).
TOMBSTONE_PREFIX = "erased:"
# The purposes of the tombstones' keyed digests: the principal, and the fingerprint.
TOMBSTONE = "tombstone"
TOMBSTONE_FINGERPRINT = "tombstone-fingerprint"
# Ids per batch on PostgreSQL: each batch a transaction of a few tens of milliseconds.
BATCH = 50_000

_ERASE = """
UPDATE django_idempotency_record
   SET scope = %s,
       status = 2, method = '', path = '',
       -- HMAC-SHA256 of the fingerprint's SHA-256 (hex), from the key's padded halves.
       fingerprint = jsonb_build_object('digest', 'h1:' || encode(sha256(%s || sha256(%s ||
           convert_to(encode(sha256(convert_to(fingerprint::text, 'UTF8')), 'hex'), 'UTF8'))),
           'hex')),
       response_code = NULL, response_headers = NULL, response_body = NULL, body_encoding = ''
 WHERE id >= %s AND id < %s AND scope = %s
"""
_ID_RANGE = "SELECT min(id), max(id) FROM django_idempotency_record"


def tombstone_scope(using: str, principal: str) -> str:
    """The principal of ``principal``'s tombstones in the records' database ``using``."""
    return _tombstone(digests.purpose_key(using, TOMBSTONE), principal)


@lru_cache(maxsize=4096)
def _tombstone(key: bytes, principal: str) -> str:
    # Every claim asks: cached, by the key (a database migrated anew has another).
    plain = hashlib.sha256(principal.encode()).hexdigest().encode()
    return TOMBSTONE_PREFIX + digests.PREFIX + hmac.digest(key, plain, "sha256").hex()


def _fingerprint_digest(using: str, fingerprint: Any) -> dict[str, str]:
    # As _ERASE computes it in SQL (PostgreSQL's text of the jsonb aside).
    text = json.dumps(fingerprint, sort_keys=True).encode()
    plain = hashlib.sha256(text).hexdigest().encode()
    return {"digest": digests.digest_hex(using, TOMBSTONE_FINGERPRINT, plain)}


def erase(using: str, principal: str, *, batch: int) -> int:
    """Turn ``principal``'s finished records (requests' and consumers') into tombstones, one
    transaction per batch; returns how many. Logged, and signalled (``records_erased``).
    Running it again erases nothing more."""
    started = time.monotonic()
    erased = sum(_batches(using, principal, batch))
    # The log names the tombstones' principal, not the erased one.
    logger.info(
        "Erased %d idempotency records of principal %s on %r in %.1fs.",
        erased,
        tombstone_scope(using, principal),
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
    scope = tombstone_scope(using, principal)
    inner, outer = digests.hmac_pads(using, TOMBSTONE_FINGERPRINT)
    for start in range(low, high + 1, batch):
        with transaction.atomic(using=using), connection.cursor() as cursor:
            cursor.execute(_ERASE, [scope, outer, inner, start, start + batch, principal])
            yield max(cursor.rowcount, 0)


def _erase_plain(using: str, principal: str, batch: int) -> Iterator[int]:
    records = IdempotencyRecord.objects.using(using)
    scope = tombstone_scope(using, principal)
    mine = records.filter(scope=principal, status=IdempotencyRecord.Status.COMPLETED)
    while True:
        with transaction.atomic(using=using):
            found = list(mine.order_by("pk")[:batch])
            if not found:
                return
            # The unique index on (key, scope): an older tombstone of the same key goes.
            records.filter(scope=scope, key__in=[r.key for r in found]).delete()
            for record in found:
                records.filter(pk=record.pk).update(
                    scope=scope,
                    status=IdempotencyRecord.Status.ERASED,
                    method="",
                    path="",
                    fingerprint=_fingerprint_digest(using, record.fingerprint),
                    response_code=None,
                    response_headers=None,
                    response_body=None,
                    body_encoding="",
                )
        yield len(found)
