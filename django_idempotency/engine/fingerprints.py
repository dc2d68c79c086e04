"""The stored form of what identifies a request: its fingerprint parts and a principal too
long to store, as keyed digests (``storage.digests``); and the plain SHA-256 form of records
written before digests were keyed, to compare a retry of one of those."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from django_idempotency.storage import digests

FINGERPRINT = "fingerprint"
PRINCIPAL = "principal"


def keyed_parts(using: str, messages: Mapping[str, bytes]) -> dict[str, str]:
    """A keyed digest of each part, for the records' database ``using``."""
    return {name: digests.digest_hex(using, FINGERPRINT, m) for name, m in messages.items()}


def plain_parts(messages: Mapping[str, bytes]) -> dict[str, str]:
    """The parts as records from before keyed digests hold them (plain SHA-256)."""
    return {name: hashlib.sha256(message).hexdigest() for name, message in messages.items()}


def principal_digest(using: str, principal: bytes) -> str:
    """A principal stored as a digest: keyed, over its SHA-256."""
    return digests.digest_hex(using, PRINCIPAL, hashlib.sha256(principal).hexdigest().encode())
