"""The cursors that the records' statements run on, on PostgreSQL.

Two kinds, whatever cursor the project's ``OPTIONS`` give Django:

- **binary**: binds its parameters on the server and reads results in binary, so that a body
  travels as its bytes both ways (Django's cursor binds on the client: a hex literal out, hex
  text back, each several times slower per MB);
- **client-bound**: binds on the client, so that several statements travel as one string (the
  store and its ``COMMIT``), even where ``server_side_binding`` is on.

Their statements are unnamed, as PgBouncer's transaction pooling needs.

The request path's statements (``fetch_one()``, ``execute()``) run on driver cursors kept per
connection: a cursor that runs the same SQL again keeps the adapters of its parameters and
its row, which a new cursor looks up and builds afresh. While something observes Django's
cursors (query logging, ``connection.execute_wrapper()``, an agent that patched
``CursorWrapper.execute``), the kept cursor is wrapped as Django wraps its own, so that each
statement reaches them; otherwise it runs inside Django's error wrapping alone. What that
saves: docs/how-it-works.md, "Speed".
"""

from __future__ import annotations

import functools
from datetime import datetime, tzinfo
from typing import TYPE_CHECKING, Any, cast

from django.db.backends.utils import CursorWrapper

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from psycopg import ClientCursor, Cursor
    from psycopg.adapt import Loader

_TIMESTAMPTZ_OID = 1184
# As Django ships it: an agent that replaces it (Sentry's SDK does) must see our statements.
_DJANGO_EXECUTE = CursorWrapper.execute
# A kept cursor holds its last result until its next statement: one that read more than
# this is dropped instead, so a large body is not kept in memory between requests.
KEPT_RESULT_MAX_BYTES = 32 * 1024


def binary_cursor(connection: BaseDatabaseWrapper) -> CursorWrapper:
    """A new binary cursor on Django's PostgreSQL connection, wrapped as Django wraps its
    own cursors: query logging, execute wrappers and errors work alike."""
    _ready(connection)
    with connection.wrap_database_errors:
        raw = _binary(connection)
    return _wrapped(connection, raw)


def fetch_one(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any]
) -> tuple[Any, ...] | None:
    """Run one statement on the connection's kept binary cursor; its row, or None."""
    _ready(connection)
    kept = _kept(connection)
    cursor = kept.binary
    # A cursor keeps the time zone's loader it was made with (override_settings changes it).
    if cursor is None or kept.zone is not connection.timezone:
        with connection.wrap_database_errors:
            cursor = kept.binary = _binary(connection)
        kept.zone = connection.timezone
    row = cast("tuple[Any, ...] | None", _run(connection, cursor, sql, params).fetchone())
    if row is not None and _large(row):
        kept.binary = None
        cursor.close()
    return row


def fetch_one_opening(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any]
) -> tuple[Any, ...] | None:
    """``fetch_one()`` for the first statement of a transaction: where psycopg would send
    its ``BEGIN`` in a round trip of its own, the ``BEGIN`` travels in the statement's
    message instead (bound on the client, results as text). One round trip, not two."""
    _ready(connection)
    raw = connection.connection
    begin = _begin(raw)
    if begin is None:
        return fetch_one(connection, sql, params)
    kept = _kept(connection)
    cursor = kept.client
    if cursor is None:
        from psycopg import ClientCursor

        with connection.wrap_database_errors:
            cursor = kept.client = ClientCursor(connection.connection)
    # psycopg starts a transaction only when it is not in autocommit: told it is for the
    # call, it sends the string as it is, whose BEGIN is exactly the one it would have sent
    # (with the connection's isolation level, read-only and deferrable options).
    raw._autocommit = True
    try:
        result = _run(connection, cursor, f"{begin}; {sql}", params)
    finally:
        raw._autocommit = False
    result.nextset()
    row = cast("tuple[Any, ...] | None", result.fetchone())
    if row is not None and _large(row):
        kept.client = None
        cursor.close()
    return row


def _begin(raw: Any) -> str | None:
    """The ``BEGIN`` psycopg would send before the next statement on ``raw``, or None when
    it would send none (autocommit, a transaction already open, a pipeline) or when this
    psycopg does not expose what it sends."""
    from psycopg.pq import TransactionStatus

    if raw.autocommit or getattr(raw, "_pipeline", True) is not None:
        return None
    if raw.pgconn.transaction_status != TransactionStatus.IDLE:
        return None
    start = getattr(raw, "_get_tx_start_command", None)
    if start is None or not hasattr(raw, "_autocommit"):
        return None
    return bytes(start()).decode()


def execute(connection: BaseDatabaseWrapper, sql: str, params: list[Any]) -> None:
    """Run statements bound on the client, as one string, on the connection's kept
    client-bound cursor."""
    _ready(connection)
    kept = _kept(connection)
    cursor = kept.client
    if cursor is None:
        from psycopg import ClientCursor

        with connection.wrap_database_errors:
            cursor = kept.client = ClientCursor(connection.connection)
    _run(connection, cursor, sql, params)


def _run(connection: BaseDatabaseWrapper, cursor: Any, sql: str, params: list[Any]) -> Any:
    """Execute on a kept cursor, through Django's wrapper while something observes it;
    what to read the result from."""
    if _observed(connection):
        wrapped = _wrapped(connection, cursor)
        wrapped.execute(sql, params)
        return wrapped
    connection.validate_no_broken_transaction()
    with connection.wrap_database_errors:
        cursor.execute(sql, params)
    return cursor


class _Kept:
    """The driver cursors kept for one connection to the server."""

    __slots__ = ("binary", "client", "raw", "zone")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.binary: Cursor[Any] | None = None
        self.zone: tzinfo | None = None
        self.client: ClientCursor[Any] | None = None


_KEPT = "_django_idempotency_cursors"


def _kept(connection: BaseDatabaseWrapper) -> _Kept:
    """This connection's kept cursors; new ones after Django reconnected, and for each
    statement while threads share the connection."""
    raw = connection.connection
    if connection.allow_thread_sharing:
        # Threads that share the connection would read each other's rows: a cursor each.
        return _Kept(raw)
    kept: _Kept | None = getattr(connection, _KEPT, None)
    if kept is None or kept.raw is not raw:
        kept = _Kept(raw)
        setattr(connection, _KEPT, kept)
    return kept


def _ready(connection: BaseDatabaseWrapper) -> None:
    # What BaseDatabaseWrapper.cursor() does before it makes a cursor.
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()


def _observed(connection: BaseDatabaseWrapper) -> bool:
    """Whether anything watches the statements of Django's cursors."""
    return bool(
        connection.queries_logged
        or connection.execute_wrappers
        or CursorWrapper.execute is not _DJANGO_EXECUTE
    )


def _wrapped(connection: BaseDatabaseWrapper, raw: Any) -> CursorWrapper:
    # django-stubs type these as taking a CursorWrapper; they wrap a driver's cursor.
    wrap = connection.make_debug_cursor if connection.queries_logged else connection.make_cursor
    return wrap(cast("CursorWrapper", raw))


def _binary(connection: BaseDatabaseWrapper) -> Cursor[Any]:
    from psycopg import Cursor
    from psycopg.pq import Format

    raw = connection.connection
    # On the connection, before the cursor copies its adapters: Django never asks for
    # binary results itself, so its own queries are untouched.
    adapters = raw.adapters
    loader = _timestamptz_loader(connection.timezone)
    if adapters.get_loader(_TIMESTAMPTZ_OID, Format.BINARY) is not loader:
        adapters.register_loader("timestamptz", loader)
    cursor = Cursor(raw)
    cursor.format = Format.BINARY
    return cursor


def _large(row: tuple[Any, ...]) -> bool:
    return any(
        isinstance(value, bytes | memoryview) and len(value) > KEPT_RESULT_MAX_BYTES
        for value in row
    )


@functools.cache
def _timestamptz_loader(zone: tzinfo | None) -> type[Loader]:
    """Binary timestamptz loaded as Django loads the text form on its connection: in
    Django's time zone (UTC under USE_TZ), or naive without USE_TZ."""
    from psycopg.types.datetime import TimestamptzBinaryLoader

    class DjangoTimestamptzBinaryLoader(TimestamptzBinaryLoader):
        def load(self, data: Any) -> datetime:
            return super().load(data).replace(tzinfo=zone)

    return DjangoTimestamptzBinaryLoader
