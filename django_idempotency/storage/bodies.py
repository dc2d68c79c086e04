"""How a response body is stored: raw, compressed here (zstd, or zlib where zstd is not
installed), or left to PostgreSQL's lz4."""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from functools import cache

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

ZLIB = "zlib"
ZSTD = "zstd"
# The codecs a record may name in body_encoding, and the HTTP content coding of each format:
# zlib's format is HTTP's "deflate" (RFC 9110), zstd's frame is HTTP's "zstd" (RFC 8878).
CONTENT_CODINGS = {ZLIB: "deflate", ZSTD: "zstd"}
# zlib level 1 compresses JSON about as well as level 6 at a third of the CPU; zstd level 3
# (its default) stores less than zlib 1 in less time (bench/bodies_bench.py).
ZLIB_LEVEL = 1
ZSTD_LEVEL = 3
# pg_attribute.attcompression of a column that PostgreSQL compresses with lz4.
LZ4 = "l"

# Per database (alias, name): whether PostgreSQL compresses stored bodies itself. Read
# once per process; a stale answer costs only speed, since each record says how its body
# is stored.
_lz4_columns: dict[tuple[str, str], bool] = {}
_COLUMN_COMPRESSION = (
    "SELECT attcompression FROM pg_attribute "
    "WHERE attrelid = to_regclass('django_idempotency_record') AND attname = 'response_body'"
)


class ZstdMissing(ImproperlyConfigured):
    """A record stored with zstd, read by a process that has no zstd."""

    def __init__(self) -> None:
        super().__init__(
            "A stored response is compressed with zstd, which this process cannot read. "
            "Install django-idempotency[zstd] (the zstandard package; Python 3.14 has it as "
            "compression.zstd) on every server that reads the records, or set "
            'IDEMPOTENCY_BODY_COMPRESSION = "zlib" until all of them have it.'
        )


@cache
def zstd_codec() -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]] | None:
    """zstd's (compress, decompress): the standard library's on Python 3.14+, else the
    zstandard package's (the "zstd" extra); None when neither is installed."""
    try:
        stdlib = importlib.import_module("compression.zstd")
    except ImportError:
        pass
    else:
        return (
            lambda body: stdlib.compress(body, level=ZSTD_LEVEL),
            stdlib.decompress,
        )
    try:
        zstandard = importlib.import_module("zstandard")
    except ImportError:
        return None
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    # The frames we write carry their content size, so one-shot decompression sizes its output.
    decompressor = zstandard.ZstdDecompressor()
    return compressor.compress, decompressor.decompress


def compression(setting: str | None) -> str:
    """The codec new records are compressed with: ``IDEMPOTENCY_BODY_COMPRESSION``, or zstd
    when it is installed and zlib otherwise."""
    if setting is not None:
        return setting
    return ZSTD if zstd_codec() is not None else ZLIB


def database_compresses(using: str) -> bool:
    """Whether PostgreSQL compresses the records' bodies with lz4 (the migration sets it
    where the server has lz4): storing 1 MB raw then costs a third of compressing it with
    zlib level 1 here, and a replay no inflating."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return False
    database = (using, str(connection.settings_dict["NAME"]))
    found = _lz4_columns.get(database)
    if found is None:
        with connection.cursor() as cursor:
            cursor.execute(_COLUMN_COMPRESSION)
            row = cursor.fetchone()
        found = _lz4_columns[database] = row is not None and row[0] == LZ4
    return found


def encode_body(
    using: str, body: bytes, min_bytes: int, *, sealed: bool = False, codec: str | None = None
) -> tuple[bytes, str]:
    """The body as stored, and how: compressed here with ``codec`` (see ``compression``) when
    it is large, that pays, and the database does not compress it itself (it cannot once
    the body is ``sealed``: a ciphertext does not compress)."""
    if len(body) >= min_bytes and (sealed or not database_compresses(using)):
        codec = compression(codec)
        compressed = _compress(codec, body)
        if len(compressed) < len(body):
            return compressed, codec
    return body, ""


def decode_body(stored: bytes | memoryview | None, encoding: str) -> bytes:
    body = bytes(stored or b"")
    if encoding == ZLIB:
        return zlib.decompress(body)
    if encoding == ZSTD:
        codec = zstd_codec()
        if codec is None:
            raise ZstdMissing
        return codec[1](body)
    return body


def _compress(codec: str, body: bytes) -> bytes:
    if codec == ZSTD:
        found = zstd_codec()
        if found is None:
            raise ZstdMissing
        return found[0](body)
    return zlib.compress(body, ZLIB_LEVEL)
