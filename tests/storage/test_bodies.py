"""How a response body is stored (``storage.bodies``); lz4 detection is in test_storage.py."""

from __future__ import annotations

import zlib

import pytest
import zstandard
from django.db import DEFAULT_DB_ALIAS

from django_idempotency.storage import bodies

JSON = b'{"amount": 2499, "currency": "inr"}' * 100


@pytest.fixture
def app_compresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: False)


@pytest.mark.usefixtures("app_compresses")
def test_a_large_body_is_stored_zstd_compressed_where_zstd_is_installed() -> None:
    stored, encoding = bodies.encode_body(DEFAULT_DB_ALIAS, JSON, len(JSON))
    assert encoding == bodies.ZSTD
    assert zstandard.ZstdDecompressor().decompress(stored) == JSON
    assert bodies.decode_body(memoryview(stored), encoding) == JSON


@pytest.mark.usefixtures("app_compresses")
def test_the_setting_zlib_stores_zlib_at_level_1_and_decodes_back() -> None:
    stored, encoding = bodies.encode_body(DEFAULT_DB_ALIAS, JSON, len(JSON), codec=bodies.ZLIB)
    assert (stored, encoding) == (zlib.compress(JSON, 1), bodies.ZLIB)
    assert bodies.decode_body(memoryview(stored), encoding) == JSON


def test_zstd_stores_json_smaller_than_zlib_level_1() -> None:
    row = b'{"id": %d, "amount": %d, "currency": "inr"},'
    body = b"".join(row % (i, i * 7) for i in range(3000))
    zstd = bodies.encode_body(DEFAULT_DB_ALIAS, body, 0, sealed=True, codec=bodies.ZSTD)[0]
    assert len(zstd) < len(zlib.compress(body, bodies.ZLIB_LEVEL))


def test_records_stored_with_zlib_are_still_read() -> None:
    assert bodies.decode_body(zlib.compress(JSON, 6), bodies.ZLIB) == JSON


@pytest.mark.usefixtures("app_compresses")
def test_without_zstd_new_bodies_are_zlib_and_zstd_records_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stored_zstd = zstandard.ZstdCompressor().compress(JSON)
    monkeypatch.setattr(bodies, "zstd_codec", lambda: None)
    assert bodies.encode_body(DEFAULT_DB_ALIAS, JSON, 0)[1] == bodies.ZLIB
    with pytest.raises(bodies.ZstdMissing, match=r"django-idempotency\[zstd\]"):
        bodies.decode_body(stored_zstd, bodies.ZSTD)


@pytest.mark.usefixtures("app_compresses")
def test_a_body_below_the_threshold_is_stored_as_it_is() -> None:
    assert bodies.encode_body(DEFAULT_DB_ALIAS, JSON, len(JSON) + 1) == (JSON, "")


def test_where_the_database_compresses_the_app_stores_the_body_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: True)
    assert bodies.encode_body(DEFAULT_DB_ALIAS, JSON, 0) == (JSON, "")


def test_a_raw_or_missing_body_decodes_as_it_is() -> None:
    assert bodies.decode_body(JSON, "") == JSON
    assert bodies.decode_body(None, "") == b""
