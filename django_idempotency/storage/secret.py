"""The app's own secret, which keys the lock of a key and the downstream keys.

The app's migration makes it at random, in a table of its own, wherever the records live: every
app server that claims in a database shares that database's secret, whatever its
``SECRET_KEY``. It is read once per process and database; the request path then only looks
it up here.
"""

from __future__ import annotations

import contextlib

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction

TABLE = "django_idempotency_secret"
_READ = f"SELECT secret FROM {TABLE} WHERE id = 1"

# Per database (alias, name): its secret. A test database has the alias of the real one.
_found: dict[tuple[str, str], str] = {}


class SecretMissing(ImproperlyConfigured):
    """The database has no secret: django_idempotency's migrations have not run there."""


def shared_secret(using: str) -> str:
    """The secret of the database ``using``, read from it the first time."""
    connection = connections[using]
    database = (using, str(connection.settings_dict["NAME"]))
    found = _found.get(database)
    if found is None:
        found = _found[database] = _read(using)
    return found


def reread_secret(using: str) -> str:
    """The secret of the database ``using``, read from it now (and remembered)."""
    connection = connections[using]
    found = _found[(using, str(connection.settings_dict["NAME"]))] = _read(using)
    return found


def forget() -> None:
    """Read the secrets again on next use (a test that migrated a database back and forth)."""
    _found.clear()


def _read(using: str) -> str:
    connection = connections[using]
    # Inside a transaction (ATOMIC_REQUESTS), a failed read must not break it.
    atomic = transaction.atomic(using=using) if connection.in_atomic_block else None
    try:
        with atomic or contextlib.nullcontext(), connection.cursor() as cursor:
            cursor.execute(_READ)
            row = cursor.fetchone()
    except DatabaseError:
        # A lost connection is not a missing table: that one goes on as it is.
        if TABLE in connection.introspection.table_names():
            raise
        row = None
    if row is None or not row[0]:
        raise SecretMissing(
            f"The database {using!r} has no django_idempotency secret (table {TABLE}): "
            "django_idempotency's migrations have not run there. Run `manage.py migrate "
            f"django_idempotency --database {using}`. If the table exists but is empty, "
            "migrate django_idempotency back to before its shared_secret migration and "
            "forward again (this makes a new secret: see IDEMPOTENCY_SECRET_KEY_FALLBACKS)."
        )
    return str(row[0])
