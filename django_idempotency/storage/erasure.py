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
from datetime import timedelta
from functools import lru_cache
from typing import Any

from django.db import connections, transaction

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord, StoredErrorCount
from django_idempotency.storage import digests

logger = logging.getLogger("django_idempotency")

# A tombstone's principal: this prefix and a keyed digest (storage/digests.py) of the SHA-256
# (hex) of the principal; the claim still finds a plain "erased:<SHA-256>" when asked without
# the keyed form. No principal is stored with this prefix (http/identity.py).
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
# The lock space of the claims' advisory locks (the migration's functions): a transaction that
# holds one is a request or a consumer in flight, which may yet commit its record.
CLAIM_LOCK_SPACE = 1768187245
_IN_FLIGHT = """
SELECT DISTINCT virtualtransaction FROM pg_locks
 WHERE locktype = 'advisory' AND classid = %s::oid AND objsubid = 2 AND granted
   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND pid <> pg_backend_pid()
"""
# A transaction holds the lock of its own virtual transaction id until it ends.
_RUNNING = """
SELECT count(*) FROM pg_locks WHERE locktype = 'virtualxid' AND virtualxid = ANY(%s::text[])
"""
# How long erasure waits for the claims that were in flight when it began, by default.
WAIT = timedelta(seconds=60)
_POLL_SECONDS = 0.05


class ErasureIncomplete(Exception):
    """Claims in flight when erasure began were still running when it stopped waiting:
    they may commit records of the principal after it. Run the erasure again."""

    def __init__(self, erased: int, pending: int, waited: timedelta) -> None:
        super().__init__(
            f"{pending} request(s) or consumer(s) in flight when the erasure began were still "
            f"running after {waited.total_seconds():g}s; what they commit was not erased. Run "
            "the erasure again once they have finished."
        )
        self.erased = erased
        self.pending = pending


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


def erase(using: str, principal: str, *, batch: int, wait: timedelta = WAIT) -> int:
    """Turn ``principal``'s finished records (requests' and consumers') into tombstones, one
    transaction per batch; returns how many. Then waits up to ``wait`` for the claims that
    were in flight when it began, and erases what they committed; raises ErasureIncomplete
    (after logging and signalling what it erased) if some still run. Logged, and signalled
    (``records_erased``). Running it again erases nothing more."""
    started = time.monotonic()
    # The principal's count of stored 4xx names it too (rows of a minute or two).
    StoredErrorCount._default_manager.using(using).filter(scope=principal).delete()
    in_flight = _in_flight(using, principal)
    erased = sum(_batches(using, principal, batch))
    pending = _wait_for(using, principal, in_flight, wait) if in_flight else 0
    if in_flight:
        # What they committed, wherever its id fell: erasing again skips what is erased.
        erased += sum(_batches(using, principal, batch))
    # The log names the tombstones' principal, not the erased one.
    logger.info(
        "Erased %d idempotency records of principal %s on %r in %.1fs.",
        erased,
        tombstone_scope(using, principal),
        using,
        time.monotonic() - started,
    )
    signals.records_erased.send_robust(None, principal=principal, count=erased, using=using)
    if pending:
        logger.error(
            "Erasure of principal %s on %r is incomplete: %d claim(s) in flight when it began "
            "still ran after %.1fs; run it again.",
            tombstone_scope(using, principal),
            using,
            pending,
            wait.total_seconds(),
        )
        raise ErasureIncomplete(erased, pending, wait)
    return erased


def _in_flight(using: str, principal: str) -> list[str]:
    """What may still commit records of ``principal``: on PostgreSQL the transactions that
    hold a claim's lock (any principal's: a lock id does not say whose), elsewhere the
    principal's in-progress rows (their ids)."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return [str(pk) for pk in _in_progress(using, principal)]
    with connection.cursor() as cursor:
        cursor.execute(_IN_FLIGHT, [CLAIM_LOCK_SPACE])
        return [row[0] for row in cursor.fetchall()]


def _in_progress(using: str, principal: str) -> list[int]:
    mine = IdempotencyRecord.objects.using(using).filter(
        scope=principal, status=IdempotencyRecord.Status.IN_PROGRESS
    )
    return list(mine.values_list("pk", flat=True))


def _wait_for(using: str, principal: str, in_flight: list[str], wait: timedelta) -> int:
    """Wait up to ``wait`` for ``in_flight`` to end; how many still run."""
    connection = connections[using]
    deadline = time.monotonic() + wait.total_seconds()
    while True:
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(_RUNNING, [in_flight])
                row = cursor.fetchone()
            running = int(row[0]) if row else 0
        else:
            running = len(set(in_flight) & {str(pk) for pk in _in_progress(using, principal)})
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(_POLL_SECONDS)


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
