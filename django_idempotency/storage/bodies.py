"""How a response body is stored: raw, zlib-compressed here, or left to PostgreSQL's lz4."""

from __future__ import annotations

import zlib

from django.db import connections

ZLIB = "zlib"
# zlib level 1 compresses JSON about as well as level 6 at a third of the CPU.
ZLIB_LEVEL = 1
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
    using: str, body: bytes, min_bytes: int, *, sealed: bool = False
) -> tuple[bytes, str]:
    """The body as stored, and how: compressed here when it is large, that pays, and the
    database does not compress it itself (it cannot once the body is ``sealed``: a
    ciphertext does not compress)."""
    if len(body) >= min_bytes and (sealed or not database_compresses(using)):
        compressed = zlib.compress(body, ZLIB_LEVEL)
        if len(compressed) < len(body):
            return compressed, ZLIB
    return body, ""


def decode_body(stored: bytes | memoryview | None, encoding: str) -> bytes:
    body = bytes(stored or b"")
    return zlib.decompress(body) if encoding == ZLIB else body
