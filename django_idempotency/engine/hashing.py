"""Keyed hashes with a secret of the app's own: the lock that serialises a key, and the
keys sent downstream. A client chooses its keys but never sees the secret, so it can
neither forge a lock collision nor predict a downstream key.

The secret is ``IDEMPOTENCY_SECRET_KEY`` when set, else the one that the app's migration
made in the records' database (``storage.secret``), which every app server on that database
shares by construction. ``IDEMPOTENCY_SECRET_KEY_FALLBACKS`` are older secrets during a
rotation: a claim then also takes the locks under them, so that servers on either side of
the rotation still serialise a key.
"""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import conf
from django_idempotency.storage.secret import reread_secret, shared_secret


@lru_cache(maxsize=32)
def _keyed(secret: str, purpose: str) -> hmac.HMAC:
    # One key per purpose, so a lock id never says anything about a downstream key. Keyed
    # once and copied per message: a one-shot hmac.digest() makes OpenSSL 3 look the digest
    # up again each time, which costs a claim more than the HMAC itself.
    key = hashlib.sha256(f"django_idempotency:{purpose}:{secret}".encode()).digest()
    return hmac.new(key, digestmod=hashlib.sha256)


MISMATCH_FIX = (
    "remove IDEMPOTENCY_SECRET_KEY from this server's settings: every server then keys its "
    "locks and downstream keys with the database's own secret (servers of an older version "
    "still in flight: see IDEMPOTENCY_SECRET_KEY_FALLBACKS in the settings docs)."
)


class SecretMismatch(ImproperlyConfigured):
    """``IDEMPOTENCY_SECRET_KEY`` is set and is not the records' database's secret: this
    server would serialise keys under a lock of its own, so its claims are refused."""


def current_secret(using: str) -> str:
    """The secret keys are made with for the records' database ``using``: the database's,
    whatever this server's settings say (``check_secret()`` refuses a server that disagrees)."""
    return shared_secret(using)


def secret_mismatch(using: str) -> str | None:
    """Why this server's ``IDEMPOTENCY_SECRET_KEY`` disagrees with the database ``using``, or
    None when it is unset or the same. The database is read again before saying so, in case
    its secret changed since this process read it."""
    declared = conf.SECRET_KEY
    if declared is None or hmac.compare_digest(declared, shared_secret(using)):
        return None
    if hmac.compare_digest(declared, reread_secret(using)):
        return None
    return (
        f"IDEMPOTENCY_SECRET_KEY is set on this server and is not the secret of the records' "
        f"database {using!r} (table django_idempotency_secret), which every other server locks "
        "keys with"
    )


def check_secret(using: str) -> None:
    """Raise ``SecretMismatch`` if this server's declared secret is not the database's."""
    problem = secret_mismatch(using)
    if problem is not None:
        raise SecretMismatch(
            f"{problem}: under a secret of its own, this server could run a key that another "
            f"server is running. Fix: {MISMATCH_FIX}"
        )


def keyed_digest(secret: str, purpose: str, *parts: str) -> bytes:
    """HMAC-SHA256 of ``parts`` (unambiguously joined) under ``secret``."""
    message = "\x00".join(f"{len(part)}:{part}" for part in parts).encode()
    mac = _keyed(secret, purpose).copy()
    mac.update(message)
    return mac.digest()


def keyed_lock(secret: str, principal: str, key: str) -> int:
    """The id of the advisory lock of (principal, key) under ``secret``."""
    return int.from_bytes(keyed_digest(secret, "lock", principal, key)[:4], "big", signed=True)


def lock_id(using: str, principal: str, key: str) -> int:
    """The signed 32-bit id of the advisory lock that serialises (principal, key)."""
    return keyed_lock(current_secret(using), principal, key)


def claim_locks(using: str, principal: str, key: str) -> tuple[int, tuple[int, ...]]:
    """The claim's lock (``lock_id()``), and the locks of (principal, key) under the
    fallback secrets that differ from it: none unless fallbacks are set. Raises
    ``SecretMismatch`` for a server whose declared secret is not the database's."""
    check_secret(using)
    lock = lock_id(using, principal, key)
    fallbacks = conf.SECRET_KEY_FALLBACKS
    if not fallbacks:
        return lock, ()
    others = {keyed_lock(secret, principal, key) for secret in fallbacks} - {lock}
    return lock, tuple(sorted(others))
