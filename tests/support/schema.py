"""What a chain of migrations makes: migrate a fresh database with one, and read back its
schema from the catalog, so two chains can be compared
(tests/storage/test_squashed_migration.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from typing import Any

from django.db import connection as default_connection
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.state import ModelState
from django.db.utils import load_backend
from django.test import override_settings

APP = "django_idempotency"
SQUASHED = "django_idempotency.migrations"
OLD_CHAIN = "tests.support.old_migrations"


def model_states(modules: str) -> dict[str, ModelState]:
    """The app's models as the chain in ``modules`` leaves them (no database needed)."""
    with override_settings(MIGRATION_MODULES={APP: modules}):
        loader = MigrationLoader(None, ignore_no_migrations=True)
        state = loader.project_state([node for node in loader.graph.leaf_nodes() if node[0] == APP])
    return {name: model for (app, name), model in state.models.items() if app == APP}


def comparable(model: ModelState) -> dict[str, Any]:
    """A model state as plain values: fields by name (their order is the chain's history),
    options with their indexes and constraints deconstructed."""
    options = dict(model.options)
    for kind in ("indexes", "constraints"):
        options[kind] = sorted(repr(item.deconstruct()) for item in options.get(kind, []))
    return {
        "fields": {name: field.deconstruct()[1:] for name, field in model.fields.items()},
        "options": options,
        "bases": model.bases,
        "managers": [(name, manager.deconstruct()) for name, manager in model.managers],
    }


@contextmanager
def fresh_database(name: str) -> Iterator[BaseDatabaseWrapper]:
    """A new, empty database ``name`` beside the test database, and a connection to it."""
    settings = {**default_connection.settings_dict, "NAME": name}
    with default_connection._nodb_cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        cursor.execute(f'CREATE DATABASE "{name}"')
    wrapper: BaseDatabaseWrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(
        settings, alias=name
    )
    # Registered, for the transactions the schema editor opens by alias.
    connections[name] = wrapper
    try:
        yield wrapper
    finally:
        wrapper.close()
        del connections[name]
        with default_connection._nodb_cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(connection: BaseDatabaseWrapper, modules: str) -> None:
    """Apply the app's chain in ``modules`` to ``connection``'s database, and nothing else."""
    with override_settings(MIGRATION_MODULES={APP: modules}):
        executor = MigrationExecutor(connection)
        leaves = [node for node in executor.loader.graph.leaf_nodes() if node[0] == APP]
        executor.migrate(leaves)


# The catalog of the current schema: every relation but the migration recorder's, its
# columns, indexes, constraints, the functions with their whole definitions, sequences.
CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind::text, pg_get_partkeydef(c.oid),
               pg_get_expr(c.relpartbound, c.oid), parent.relname,
               obj_description(c.oid, 'pg_class'), c.relpersistence::text,
               coalesce(c.reloptions, '{}')
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
          LEFT JOIN pg_class parent ON parent.oid = i.inhparent
         WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'S', 'v', 'm')
           AND c.relname NOT LIKE 'django\\_migrations%%'""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attidentity::text,
               a.attgenerated::text, a.attcompression::text, a.attstorage::text
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p')
           AND a.attnum > 0 AND NOT a.attisdropped
           AND c.relname NOT LIKE 'django\\_migrations%%'""",
    "indexes": """
        SELECT pg_get_indexdef(i.indexrelid), i.indisunique, i.indisprimary
          FROM pg_index i
          JOIN pg_class c ON c.oid = i.indrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_schema() AND c.relname NOT LIKE 'django\\_migrations%%'""",
    "constraints": """
        SELECT c.relname, con.conname, con.contype::text, pg_get_constraintdef(con.oid)
          FROM pg_constraint con
          JOIN pg_class c ON c.oid = con.conrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_schema() AND c.relname NOT LIKE 'django\\_migrations%%'""",
    "functions": """
        SELECT p.proname, pg_get_functiondef(p.oid)
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = current_schema()""",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, max_value, increment_by,
               cycle, cache_size
          FROM pg_sequences WHERE schemaname = current_schema()
           AND sequencename NOT LIKE 'django\\_migrations%%'""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_schema() AND NOT t.tgisinternal""",
    # The secret's value is random: that there is one, of its length.
    "secret": "SELECT id, length(secret) FROM django_idempotency_secret",
}

DAY_IN_NAME = re.compile(r"_p(\d{4})(\d\d)(\d\d)")
AUTO_INDEX = re.compile(r"INDEX \S+_idx\d* ON public\.(\S+_p<day[+-]\d+>)")
DAY_IN_BOUND = re.compile(r"'(\d{4})-(\d\d)-(\d\d) 00:00:00\+00'")


def schema(connection: BaseDatabaseWrapper) -> dict[str, list[tuple[Any, ...]]]:
    """The catalog of ``connection``'s database, each partition's day written as its offset
    from the first partition's, so that two databases migrated on either side of midnight
    UTC compare equal."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    with connection.cursor() as cursor:
        for kind, sql in CATALOG.items():
            cursor.execute(sql)
            found[kind] = cursor.fetchall()
    days = {
        date(int(y), int(m), int(d))
        for (name, *_) in found["relations"]
        for y, m, d in DAY_IN_NAME.findall(name)
    }
    first = min(days, default=date.today())

    def relative(text: object) -> object:
        if not isinstance(text, str):
            return text
        text = DAY_IN_NAME.sub(
            lambda m: f"_p<day{(date(*map(int, m.groups())) - first).days:+d}>", text
        )
        return DAY_IN_BOUND.sub(
            lambda m: f"'<day{(date(*map(int, m.groups())) - first).days:+d}>'", text
        )

    def auto_named(text: object) -> object:
        # PostgreSQL names a partition's copy of its parent's index after the partition and
        # the columns, cut to 63 characters and numbered where cut names collide: which
        # number each gets depends on the partitions' days, not on the migration.
        if isinstance(text, str):
            return AUTO_INDEX.sub(r"INDEX <auto> ON public.\1", text)
        return text

    return {
        kind: sorted(tuple(auto_named(relative(value)) for value in row) for row in rows)
        for kind, rows in found.items()
    }
