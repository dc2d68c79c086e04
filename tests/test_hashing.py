"""Keyed hashes (engine/hashing.py): locks and downstream keys must stay the same across
versions and settings reloads, so they are checked against HMAC-SHA256 written out here."""

from __future__ import annotations

import hashlib
import hmac
import threading

from django.test import override_settings

from django_idempotency.conf import conf
from django_idempotency.engine.hashing import keyed_digest, lock_id


def spec(secret: str, purpose: str, *parts: str) -> bytes:
    key = hashlib.sha256(f"django_idempotency:{purpose}:{secret}".encode()).digest()
    message = "\x00".join(f"{len(part)}:{part}" for part in parts).encode()
    return hmac.digest(key, message, "sha256")


@override_settings(IDEMPOTENCY_SECRET_KEY="first secret")
def test_keyed_digest_is_hmac_sha256_of_the_joined_parts_under_the_purposes_key() -> None:
    assert keyed_digest("downstream", "v1", "user:1", "k", "capture") == spec(
        "first secret", "downstream", "v1", "user:1", "k", "capture"
    )
    # Repeated calls share the keyed HMAC and never each other's messages.
    assert keyed_digest("lock", "a", "b") == spec("first secret", "lock", "a", "b")
    assert keyed_digest("lock", "a", "b") == spec("first secret", "lock", "a", "b")
    assert lock_id("a", "b") == int.from_bytes(
        spec("first secret", "lock", "a", "b")[:4], "big", signed=True
    )


def test_another_secret_gives_other_digests_at_once() -> None:
    with override_settings(IDEMPOTENCY_SECRET_KEY="one"):
        one = keyed_digest("lock", "a", "b")
    with override_settings(IDEMPOTENCY_SECRET_KEY="two"):
        two = keyed_digest("lock", "a", "b")
    assert one == spec("one", "lock", "a", "b") and two == spec("two", "lock", "a", "b")


def test_threads_hashing_at_once_get_their_own_digests() -> None:
    found: dict[int, bytes] = {}

    def digest(n: int) -> None:
        for _ in range(200):
            found[n] = keyed_digest("lock", "principal", str(n))

    threads = [threading.Thread(target=digest, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert found == {n: spec(conf.SECRET_KEY, "lock", "principal", str(n)) for n in range(8)}
