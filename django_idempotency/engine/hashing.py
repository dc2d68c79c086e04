"""Keyed hashes with a secret of the app's own: the lock that serialises a key, and the
keys sent downstream. A client chooses its keys but never sees the secret, so it can
neither forge a lock collision nor predict a downstream key."""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache

from django_idempotency.conf import conf


@lru_cache(maxsize=8)
def _keyed(secret: str, purpose: str) -> hmac.HMAC:
    # One key per purpose, so a lock id never says anything about a downstream key. Keyed
    # once and copied per message: a one-shot hmac.digest() makes OpenSSL 3 look the digest
    # up again each time, which costs a claim more than the HMAC itself.
    key = hashlib.sha256(f"django_idempotency:{purpose}:{secret}".encode()).digest()
    return hmac.new(key, digestmod=hashlib.sha256)


def keyed_digest(purpose: str, *parts: str) -> bytes:
    """HMAC-SHA256 of ``parts`` (unambiguously joined) under the app's secret."""
    message = "\x00".join(f"{len(part)}:{part}" for part in parts).encode()
    mac = _keyed(conf.SECRET_KEY, purpose).copy()
    mac.update(message)
    return mac.digest()


def lock_id(principal: str, key: str) -> int:
    """The signed 32-bit id of the advisory lock that serialises (principal, key)."""
    return int.from_bytes(keyed_digest("lock", principal, key)[:4], "big", signed=True)
