"""Keyed digests of what records keep: fingerprint parts, principals stored as digests,
erasure tombstones, the admin's body digest. Each is an HMAC-SHA256 under a key of its own
purpose, derived from the records' database's shared secret (``storage.secret``), so a
reader of the table cannot test guesses against them (docs/data-you-keep.md).

The database's own secret, never the ``IDEMPOTENCY_SECRET_KEY`` override: every server on a
database computes one digest of one value, whatever its settings, before and after a
rotation of the override. ``purpose_key()`` is the one place they depend on the secret.
"""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache

from django_idempotency.storage.secret import shared_secret

# The version of the keyed digests that records store ("h1:" then 64 hex digits): a value
# without it is a plain SHA-256 of a record written before, compared as such.
VERSION = "h1"
PREFIX = VERSION + ":"
# HMAC-SHA256's block: the length of the padded keys.
_BLOCK = 64


def purpose_key(using: str, purpose: str) -> bytes:
    """The key of ``purpose``'s digests for the records' database ``using``."""
    return _derived(shared_secret(using), purpose)


@lru_cache(maxsize=32)
def _derived(secret: str, purpose: str) -> bytes:
    # HKDF-Expand's single block (RFC 5869, with the secret as the pseudorandom key): one
    # key per purpose, none telling anything of another or of the secret.
    info = f"django_idempotency digest {VERSION}:{purpose}".encode()
    return hmac.digest(secret.encode(), info + b"\x01", "sha256")


@lru_cache(maxsize=32)
def _mac(key: bytes) -> hmac.HMAC:
    # Keyed once and copied per message: cheaper than hmac.digest() keying it every time.
    return hmac.new(key, digestmod=hashlib.sha256)


def keyed(using: str, purpose: str) -> hmac.HMAC:
    """A fresh HMAC of ``purpose`` to update with one message (copy of a cached one)."""
    return _mac(purpose_key(using, purpose)).copy()


def digest_hex(using: str, purpose: str, message: bytes) -> str:
    """The stored form of a keyed digest of ``message``: ``h1:`` and 64 hex digits."""
    mac = keyed(using, purpose)
    mac.update(message)
    return PREFIX + mac.hexdigest()


def is_keyed(value: object) -> bool:
    """Whether a stored digest is keyed (else a plain SHA-256 from before keyed digests)."""
    return isinstance(value, str) and value.startswith(PREFIX)


def hmac_pads(using: str, purpose: str) -> tuple[bytes, bytes]:
    """The inner and outer padded keys of ``purpose``, so that SQL computes the same HMAC
    with its built-in ``sha256()``: sha256(outer || sha256(inner || message))."""
    block = purpose_key(using, purpose).ljust(_BLOCK, b"\x00")
    return bytes(b ^ 0x36 for b in block), bytes(b ^ 0x5C for b in block)
