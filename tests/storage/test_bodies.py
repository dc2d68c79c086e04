"""How a response body is stored (``storage.bodies``); lz4 detection is in test_storage.py."""

from __future__ import annotations

import zlib

import pytest
from django.db import DEFAULT_DB_ALIAS

from django_idempotency.storage import bodies

JSON = b'{"amount": 2499, "currency": "inr"}' * 100


@pytest.fixture
def app_compresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: False)


@pytest.mark.usefixtures("app_compresses")
def test_a_large_body_is_stored_zlib_compressed_at_level_1_and_decodes_back() -> None:
    stored, encoding = bodies.encode_body(DEFAULT_DB_ALIAS, JSON, len(JSON))
    assert (stored, encoding) == (zlib.compress(JSON, 1), bodies.ZLIB)
    assert bodies.decode_body(memoryview(stored), encoding) == JSON


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
