"""Sealing stored responses: the keys' parsing, the envelope, and what binds it to its record."""

from __future__ import annotations

import base64
import os
import zlib

import pytest

from django_idempotency.storage import bodies, sealing


def new_secret() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def ring(*keys: str) -> sealing.Keyring:
    found = sealing.keyring(keys)
    assert found is not None
    return found


def sealed(keys: sealing.Keyring, body: bytes = b'{"iban": "DE89"}', **about: object):
    record = {"scope": "user:1", "key": "k1", "status": 201, **about}
    return sealing.seal(
        keys,
        headers=[["Content-Type", "application/json"]],
        body=body,
        encoding="",
        **record,  # type: ignore[arg-type]
    )


def test_no_keys_means_encryption_is_off() -> None:
    assert sealing.keyring(()) is None


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (("not base64!",), r"IDEMPOTENCY_ENCRYPTION_KEYS\[0\] is not base64"),
        ((base64.b64encode(b"x" * 16).decode(),), r"decodes to 16 bytes; it must be 32"),
        (("",), r"decodes to 0 bytes"),
        ((b"raw bytes",), r"is a bytes; it must be a base64 str"),
    ],
)
def test_a_malformed_key_is_refused_with_a_message_that_never_holds_it(keys, message) -> None:
    with pytest.raises(sealing.MalformedKeys, match=message) as raised:
        sealing.keyring(keys)
    assert "x" * 16 not in str(raised.value)


def test_a_key_listed_twice_is_refused_by_its_id() -> None:
    key = new_secret()
    urlsafe = key.replace("+", "-").replace("/", "_")
    with pytest.raises(sealing.MalformedKeys, match=r"\[0\] and \[2\] have the same key id"):
        sealing.keyring((key, new_secret(), urlsafe))


def test_the_key_id_is_short_stable_and_not_the_key() -> None:
    secret = os.urandom(32)
    key_id = sealing.key_id(secret)
    assert len(key_id) == sealing.KEY_ID_LENGTH
    assert key_id == sealing.key_id(secret)
    assert key_id not in base64.b64encode(secret).decode()


def test_the_first_key_seals_and_the_record_names_it_in_eight_characters() -> None:
    first, second = new_secret(), new_secret()
    keys = ring(first, second)
    stored, encoding = sealed(keys)
    assert encoding == "@" + keys.sealing.id
    assert sealing.sealed_under(encoding) == keys.sealing.id
    assert b"DE89" not in stored and b"Content-Type" not in stored
    _, compressed = sealing.seal(
        keys, scope="s", key="k", status=200, headers=[], body=b"x", encoding=bodies.ZLIB
    )
    assert compressed == "@" + keys.sealing.id + "z"
    assert len(compressed) <= 8
    assert sealing.inner_encoding(compressed) == bodies.ZLIB
    _, zstd = sealing.seal(
        keys, scope="s", key="k", status=200, headers=[], body=b"x", encoding=bodies.ZSTD
    )
    assert zstd == "@" + keys.sealing.id + "s"
    assert sealing.inner_encoding(zstd) == bodies.ZSTD
    assert sealing.inner_encoding(encoding) == ""


def test_every_listed_key_opens_what_it_sealed() -> None:
    old, new = new_secret(), new_secret()
    stored, encoding = sealed(ring(old))
    headers, body = sealing.unseal(
        ring(new, old), scope="user:1", key="k1", status=201, stored=stored, encoding=encoding
    )
    assert headers == [["Content-Type", "application/json"]]
    assert body == b'{"iban": "DE89"}'


def test_a_key_no_longer_listed_cannot_open_its_records() -> None:
    stored, encoding = sealed(ring(new_secret()))
    with pytest.raises(sealing.Unreadable, match="is not among IDEMPOTENCY_ENCRYPTION_KEYS"):
        sealing.unseal(
            ring(new_secret()),
            scope="user:1",
            key="k1",
            status=201,
            stored=stored,
            encoding=encoding,
        )
    with pytest.raises(sealing.Unreadable):
        sealing.unseal(None, scope="user:1", key="k1", status=201, stored=stored, encoding=encoding)


@pytest.mark.parametrize(
    "moved", [{"scope": "user:2"}, {"key": "k2"}, {"status": 200}], ids=["scope", "key", "status"]
)
def test_an_envelope_opens_only_in_the_record_it_was_sealed_for(moved) -> None:
    keys = ring(new_secret())
    stored, encoding = sealed(keys)
    where = {"scope": "user:1", "key": "k1", "status": 201, **moved}
    with pytest.raises(sealing.Unreadable, match="failed authentication"):
        sealing.unseal(keys, stored=stored, encoding=encoding, **where)  # type: ignore[arg-type]


def test_an_altered_envelope_fails_authentication() -> None:
    keys = ring(new_secret())
    stored, encoding = sealed(keys)
    altered = stored[:-1] + bytes([stored[-1] ^ 1])
    with pytest.raises(sealing.Unreadable, match="failed authentication"):
        sealing.unseal(
            keys, scope="user:1", key="k1", status=201, stored=altered, encoding=encoding
        )
    # Nor may the encoding's compression flag be flipped.
    with pytest.raises(sealing.Unreadable):
        sealing.unseal(
            keys, scope="user:1", key="k1", status=201, stored=stored, encoding=encoding + "z"
        )


def test_compression_comes_before_encryption() -> None:
    keys = ring(new_secret())
    body = b'{"pad": "0123456789abcdef"}' * 4000
    compressed = zlib.compress(body, bodies.ZLIB_LEVEL)
    stored, encoding = sealing.seal(
        keys, scope="s", key="k", status=201, headers=[], body=compressed, encoding=bodies.ZLIB
    )
    assert len(stored) < len(body) // 10
    _, inner = sealing.unseal(
        keys, scope="s", key="k", status=201, stored=stored, encoding=encoding
    )
    assert zlib.decompress(inner) == body


def test_two_seals_of_one_response_differ() -> None:
    keys = ring(new_secret())
    assert sealed(keys)[0] != sealed(keys)[0]
