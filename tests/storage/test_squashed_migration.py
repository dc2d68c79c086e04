"""The one migration of 0.1.0 makes what the 18 before it made (tests/support/old_migrations):
the same model state, and on PostgreSQL the same schema, read from the catalog of two fresh
databases: tables and partitions, columns, indexes, constraints, sequences, the functions'
whole definitions, the comments maintenance reads, the secret. On SQLite the same tables."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend

from tests.support import schema
from tests.support.schema import OLD_CHAIN, SQUASHED


def test_the_old_chain_is_kept_for_this_test_only() -> None:
    states = schema.model_states(OLD_CHAIN)
    assert len(states) == 6, "the old chain is not found"


def test_the_squashed_state_is_the_old_chains() -> None:
    old = {name: schema.comparable(model) for name, model in schema.model_states(OLD_CHAIN).items()}
    new = {name: schema.comparable(model) for name, model in schema.model_states(SQUASHED).items()}
    assert new == old


@pytest.mark.django_db
def test_the_squashed_schema_is_the_old_chains_on_postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the partitioned schema is PostgreSQL's")
    found = {}
    for name, modules in (("old", OLD_CHAIN), ("new", SQUASHED)):
        with schema.fresh_database(f"test_squash_{name}_{os.getpid()}") as fresh:
            schema.migrate(fresh, modules)
            found[name] = schema.schema(fresh)
    old, new = found["old"], found["new"]
    # Guards the comparison against reading nothing: every kind of object is there (the
    # app makes no trigger: that none appears is compared all the same).
    assert [kind for kind, rows in old.items() if not rows] == ["triggers"]
    assert {row[0] for row in old["functions"]} == {
        "django_idempotency_claim",
        "django_idempotency_store",
        "django_idempotency_lookup",
        "django_idempotency_lock_all",
    }
    for kind in schema.CATALOG:
        assert new[kind] == old[kind], kind


@contextmanager
def sqlite_database(alias: str) -> Iterator[BaseDatabaseWrapper]:
    settings: dict[str, Any] = {
        **connection.settings_dict,
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ":memory:",
        "OPTIONS": {},
    }
    wrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, alias=alias)
    connections[alias] = wrapper
    try:
        yield wrapper
    finally:
        wrapper.close()
        del connections[alias]


def sqlite_schema(wrapper: BaseDatabaseWrapper) -> dict[str, Any]:
    with wrapper.cursor() as cursor:
        cursor.execute(
            "SELECT name, tbl_name, type FROM sqlite_master "
            "WHERE name NOT LIKE 'django_migrations%' AND name NOT LIKE 'sqlite_%'"
        )
        objects = sorted(cursor.fetchall())
        tables = [name for name, _, kind in objects if kind == "table"]
        columns = {t: cursor.execute(f'PRAGMA table_info("{t}")').fetchall() for t in tables}
        indexes = {
            t: sorted(cursor.execute(f'PRAGMA index_list("{t}")').fetchall()) for t in tables
        }
        cursor.execute("SELECT count(*), min(length(secret)) FROM django_idempotency_secret")
        secret = cursor.fetchone()
    return {"objects": objects, "columns": columns, "indexes": indexes, "secret": secret}


# The old chain added the generation with raw SQL and a database default; the squash makes
# the column from the model, whose default the ORM writes on every insert (the only writer of
# records on SQLite, storage.records).
SQLITE_GENERATION_DEFAULT = {"old": "0", "new": None}


@pytest.mark.django_db
def test_the_squashed_schema_is_the_old_chains_on_sqlite() -> None:
    found = {}
    for name, modules in (("old", OLD_CHAIN), ("new", SQUASHED)):
        with sqlite_database(f"squash_sqlite_{name}") as fresh:
            schema.migrate(fresh, modules)
            found[name] = sqlite_schema(fresh)
            (generation,) = [
                column
                for column in found[name]["columns"]["django_idempotency_record"]
                if column[1] == "generation"
            ]
            assert generation[4] == SQLITE_GENERATION_DEFAULT[name]
            found[name]["columns"]["django_idempotency_record"].remove(generation)
    assert found["new"]["secret"] == (1, 64)
    assert "idempotency_key_scope_unique" in {row[0] for row in found["new"]["objects"]}
    assert found["new"] == found["old"]


@pytest.mark.django_db
def test_the_squashed_migration_goes_to_zero_and_back_on_sqlite() -> None:
    from django.db.migrations.executor import MigrationExecutor
    from django.test import override_settings

    with sqlite_database("squash_sqlite_zero") as fresh:
        schema.migrate(fresh, SQUASHED)
        with override_settings(MIGRATION_MODULES={schema.APP: SQUASHED}):
            MigrationExecutor(fresh).migrate([(schema.APP, None)])
        with fresh.cursor() as cursor:
            cursor.execute("SELECT name FROM sqlite_master WHERE name LIKE 'django_idempotency%'")
            assert cursor.fetchall() == []
        schema.migrate(fresh, SQUASHED)
        assert sqlite_schema(fresh)["secret"] == (1, 64)
