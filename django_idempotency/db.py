"""What a database error says, whatever the driver: the foundation's one helper, so that
storage and partitions, which may not import each other, read errors the same way."""

from __future__ import annotations


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (psycopg 3 or psycopg2) that Django wrapped."""
    cause = exc.__cause__
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return str(code) if code else None
