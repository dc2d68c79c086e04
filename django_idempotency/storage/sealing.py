"""Stored responses sealed at rest: AES-256-GCM under ``IDEMPOTENCY_ENCRYPTION_KEYS``, the
headers and the (compressed) body in one envelope, each record naming its key by a short id."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from django_idempotency.storage.bodies import ZLIB, ZSTD
from django_idempotency.storage.records import Record

# body_encoding of a record stored plain: as sent, or zlib's or zstd's format (storage/bodies.py).
PLAIN_ENCODINGS = frozenset(("", ZLIB, ZSTD))
# body_encoding of a sealed record: "@", the key id, then "z" when the sealed body is zlib's
# format or "s" when it is zstd's. Eight characters at most: the column is varchar(8).
SEALED = "@"
COMPRESSED = {ZLIB: "z", ZSTD: "s"}
INNER = {mark: codec for codec, mark in COMPRESSED.items()}
KEY_ID_LENGTH = 6
KEY_BYTES = 32
# A key of its own for each record (HMAC-SHA256 of the listed key and a random salt): GCM's
# random 96-bit nonces would otherwise bound a key to about 2**32 records.
SALT_BYTES = 16
NONCE_BYTES = 12
_HEAD = 4  # the length of the headers' JSON, in front of it
_KEY_ID_CONTEXT = b"django-idempotency key id\x00"
_BINDING_CONTEXT = b"django-idempotency record v1\x00"


class MalformedKeys(ValueError):
    """``IDEMPOTENCY_ENCRYPTION_KEYS`` cannot be used; the message never holds a key."""


class Unreadable(Exception):
    """A sealed record that cannot be opened: its key is not listed, or it failed
    authentication (altered, or moved from another record)."""

    def __init__(self, key_id: str, reason: str) -> None:
        super().__init__(f"a stored response sealed under key {key_id} {reason}")
        self.key_id = key_id
        self.reason = reason


class NotSealed(Unreadable):
    """A record stored plain, or with an encoding nothing wrote, while keys are set: the
    cipher authenticates only what is sealed, so it is refused, never replayed (whoever can
    write to the table could have written it). ``idempotency_reencrypt`` seals the plain
    records of before the keys were set."""

    def __init__(self, encoding: str) -> None:
        Exception.__init__(
            self,
            f"a stored response is not sealed (body_encoding {encoding!r}) although "
            "IDEMPOTENCY_ENCRYPTION_KEYS is set",
        )
        self.key_id = ""
        self.reason = "is not sealed"


@dataclass(frozen=True, slots=True)
class Key:
    id: str
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class Keyring:
    """The listed keys: the first seals, every one opens."""

    keys: tuple[Key, ...]

    @property
    def sealing(self) -> Key:
        return self.keys[0]

    def find(self, key_id: str) -> Key | None:
        return next((key for key in self.keys if key.id == key_id), None)


def key_id(secret: bytes) -> str:
    """A record's name for its key: derived from the key, and telling nothing of it."""
    digest = hashlib.sha256(_KEY_ID_CONTEXT + secret).digest()
    return base64.urlsafe_b64encode(digest).decode()[:KEY_ID_LENGTH]


@functools.lru_cache(maxsize=8)
def keyring(raw: tuple[str, ...]) -> Keyring | None:
    """The keys of the setting's value (None: encryption is off), parsed once per value.
    Raises MalformedKeys for a key that is not base64, not 32 bytes, or listed twice."""
    if not raw:
        return None
    try:
        import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
    except ImportError:
        raise MalformedKeys(
            "IDEMPOTENCY_ENCRYPTION_KEYS is set, but the cryptography package is not "
            "installed (django-idempotency[encryption])."
        ) from None
    keys: list[Key] = []
    for index, text in enumerate(raw):
        name = f"IDEMPOTENCY_ENCRYPTION_KEYS[{index}]"
        if not isinstance(text, str):
            raise MalformedKeys(f"{name} is a {type(text).__name__}; it must be a base64 str.")
        try:
            # Either alphabet: Fernet's keys and most generators use the URL-safe one.
            secret = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise MalformedKeys(f"{name} is not base64.") from None
        if len(secret) != KEY_BYTES:
            raise MalformedKeys(
                f"{name} decodes to {len(secret)} bytes; it must be {KEY_BYTES} (AES-256)."
            )
        key = Key(key_id(secret), secret)
        for other, known in enumerate(keys):
            if known.id == key.id:
                raise MalformedKeys(
                    f"IDEMPOTENCY_ENCRYPTION_KEYS[{other}] and [{index}] have the same key id "
                    f"{key.id}: the same key is listed twice."
                )
        keys.append(key)
    return Keyring(tuple(keys))


def sealed_under(encoding: str) -> str | None:
    """The key id a record's ``body_encoding`` names, or None for a record stored plain."""
    return encoding[1 : 1 + KEY_ID_LENGTH] if encoding.startswith(SEALED) else None


def inner_encoding(encoding: str) -> str:
    """How the body inside the envelope is encoded ("", zlib or zstd), for a sealed record."""
    return INNER.get(encoding[1 + KEY_ID_LENGTH :], "")


def seal(
    ring: Keyring,
    *,
    scope: str,
    key: str,
    status: int,
    headers: Sequence[Sequence[str]],
    body: bytes,
    encoding: str,
) -> tuple[bytes, str]:
    """The envelope of headers and body (encoded as ``encoding`` says: compression comes
    before encryption), and the record's ``body_encoding``."""
    sealing = ring.sealing
    sealed_encoding = SEALED + sealing.id + COMPRESSED.get(encoding, "")
    head = json.dumps(headers, separators=(",", ":")).encode()
    random = os.urandom(SALT_BYTES + NONCE_BYTES)
    cipher = _cipher(sealing.secret, random[:SALT_BYTES])
    bound = _binding(scope, key, status, sealed_encoding)
    plaintext = b"".join((len(head).to_bytes(_HEAD, "big"), head, body))
    return random + cipher.encrypt(random[SALT_BYTES:], plaintext, bound), sealed_encoding


def unseal(
    ring: Keyring | None, *, scope: str, key: str, status: int, stored: bytes, encoding: str
) -> tuple[list[list[str]], bytes]:
    """The headers and the body (still as ``inner_encoding`` says) of a sealed record."""
    from cryptography.exceptions import InvalidTag

    key_id = sealed_under(encoding) or ""
    found = ring.find(key_id) if ring is not None else None
    if found is None:
        raise Unreadable(key_id, "is not among IDEMPOTENCY_ENCRYPTION_KEYS")
    cipher = _cipher(found.secret, stored[:SALT_BYTES])
    nonce = stored[SALT_BYTES : SALT_BYTES + NONCE_BYTES]
    try:
        plaintext = cipher.decrypt(
            nonce, stored[SALT_BYTES + NONCE_BYTES :], _binding(scope, key, status, encoding)
        )
    except (InvalidTag, ValueError):  # ValueError: too short to hold a nonce
        raise Unreadable(key_id, "failed authentication: it was altered or moved") from None
    size = int.from_bytes(plaintext[:_HEAD], "big")
    headers: list[list[str]] = json.loads(plaintext[_HEAD : _HEAD + size])
    return headers, plaintext[_HEAD + size :]


def opened(
    record: Record, ring: Keyring | None, *, scope: str, key: str, plain: bool = False
) -> Record:
    """The record with its headers and body out of their envelope. A record stored plain is
    returned as it is when no keys are set (``ring`` None) or ``plain`` allows it (to seal
    or show it); with keys set it raises NotSealed, as does an encoding nothing writes.
    Raises Unreadable."""
    if sealed_under(record.body_encoding) is None:
        if record.body_encoding not in PLAIN_ENCODINGS or (ring is not None and not plain):
            raise NotSealed(record.body_encoding)
        return record
    headers, body = unseal(
        ring,
        scope=scope,
        key=key,
        status=record.response_code,
        stored=record.response_body,
        encoding=record.body_encoding,
    )
    encoding = inner_encoding(record.body_encoding)
    return replace(record, response_headers=headers, response_body=body, body_encoding=encoding)


def _cipher(secret: bytes, salt: bytes) -> Any:
    # Imported here: cryptography is needed only once keys are set (the "encryption" extra).
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(hmac.digest(secret, salt, "sha256"))


def _binding(scope: str, key: str, status: int, encoding: str) -> bytes:
    # The associated data: an envelope opens only in the record it was sealed for, with
    # that status and encoding. Length-prefixed, so no two tuples give the same bytes.
    parts = [scope.encode(), key.encode(), str(status).encode(), encoding.encode()]
    return _BINDING_CONTEXT + b"".join(len(part).to_bytes(4, "big") + part for part in parts)
