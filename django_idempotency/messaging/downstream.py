"""Downstream keys: the idempotency key to send to an external API (a payment processor)
from inside a protected view or an exactly-once task; and, derived the same way, the ids of
the messages and events such work writes.

The key is a keyed hash of the principal, the request's key (or the message id) and its
generation, the request's fingerprint and a step name, so the run that a retry re-executes after a rollback
sends the same key again and the provider deduplicates it, while another request on the same
key after a rollback (another amount) sends another key, which the provider never answers
with the first request's result. The key says nothing about its inputs.
"""

from __future__ import annotations

import json
import uuid

from django_idempotency.engine.hashing import current_secret, keyed_digest
from django_idempotency.engine.unit import UnitOfWork, current_unit

# Bumped if the derivation ever changes, so that old and new keys never meet. v3: the
# fingerprint, the records' database's secret and the key's generation are part of it (a key
# that expired or was erased runs anew as a new operation, with new downstream keys).
VERSION = "v3"
# The same for message and event ids; the execution's generation and the message's place
# in it are part of them.
MESSAGE_VERSION = "m1"


class OutsideUnitOfWork(RuntimeError):
    """``derive_key()`` was called outside a protected view or an exactly-once task."""


def derive_key(step: str) -> str:
    """The downstream idempotency key for ``step`` of the work running now: the same
    principal, key (or message id) and generation, request (its fingerprint: method, path,
    query, body…) and step always give the same key; anything else never does. A UUID-shaped string
    (version 8), which providers that want a UUID accept."""
    if not step:
        raise ValueError("derive_key() needs a step name, such as 'capture'.")
    unit = current_unit.get()
    if unit is None:
        raise OutsideUnitOfWork(
            "derive_key() derives from the key of the work running now, and there is none: "
            "call it inside a view protected by @idempotent or IdempotencyMixin (on a request "
            "that carries a key) or inside an ExactlyOnceTask."
        )
    return _derived(unit, "downstream", VERSION, str(unit.generation), step)


def message_id(using: str, kind: str) -> uuid.UUID | None:
    """The id of the next message (or event, ``kind``) the work running now writes on the
    database ``using``, named by the request: its principal, key, generation, fingerprint
    and the message's place among those it writes. An execution that runs again after its
    commit was lost (an asynchronous failover) writes the same ids, which consumers and the
    stream's deduplication have seen. None outside a keyed unit of work, or for a message
    written on another database than its records' (then random)."""
    unit = current_unit.get()
    if unit is None or unit.using != using:
        return None
    place = unit.next_place()
    return uuid.UUID(_derived(unit, kind, MESSAGE_VERSION, str(unit.generation), str(place)))


def _derived(unit: UnitOfWork, purpose: str, version: str, *after: str) -> str:
    work = unit.work
    # The fingerprint as the claim compares it: equal exactly when a retry is not refused
    # as a reused key. Its plain digests (secret inside the HMAC below), so the keys stay
    # those that releases before keyed fingerprints derived.
    request = json.dumps(work.plain_fingerprint(), sort_keys=True, separators=(",", ":"))
    secret = current_secret(unit.using)
    digest = keyed_digest(secret, purpose, version, work.principal, work.key, request, *after)
    value = int.from_bytes(digest[:16], "big")
    # RFC 9562 version 8 (custom) and variant bits; the other 122 bits are the digest's.
    value = (value & ~(0xF << 76)) | (0x8 << 76)
    value = (value & ~(0x3 << 62)) | (0x2 << 62)
    return str(uuid.UUID(int=value))
