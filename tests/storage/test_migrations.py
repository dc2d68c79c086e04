"""The app's migration: it matches the model, runs both ways, and builds the partitioned table."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions import apply, catalog
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.storage import records
from django_idempotency.storage.records import Outcome
from tests.factories import IdempotencyRecordFactory, new_key
from tests.support.claims import claim, store_first


def fetch_one(sql: str, params: list[object] | None = None) -> tuple[object, ...] | None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        row: tuple[object, ...] | None = cursor.fetchone()
    return row


@pytest.fixture(autouse=True)
def same_secret_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """Migrating back and forth makes a new secret; the live servers of the session and this
    process read theirs once, so the test's database gets its secret back."""
    marker = request.node.get_closest_marker("django_db")
    if marker is None or not marker.kwargs.get("transaction"):
        yield
        return
    (kept,) = fetch_one("SELECT secret FROM django_idempotency_secret") or (None,)
    yield
    with connection.cursor() as cursor:
        cursor.execute("UPDATE django_idempotency_secret SET secret = %s", [kept])


@pytest.mark.django_db
def test_models_match_the_migrations() -> None:
    # SystemExit(1) if makemigrations would write anything.
    call_command("makemigrations", "django_idempotency", "--check", "--dry-run", verbosity=0)


def test_app_pins_its_default_auto_field() -> None:
    config = apps.get_app_config("django_idempotency")
    assert config.default_auto_field == "django.db.models.BigAutoField"
    assert IdempotencyRecord._meta.pk.name == "id"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "auto_field", ["django.db.models.AutoField", "django.db.models.SmallAutoField"]
)
def test_models_match_the_migrations_under_another_default_auto_field(
    tmp_path: Path, subprocess_env: dict[str, str], auto_field: str
) -> None:
    (tmp_path / "other_auto_field_settings.py").write_text(
        f"from tests.settings import *  # noqa\nDEFAULT_AUTO_FIELD = {auto_field!r}\n"
    )
    env = {
        **subprocess_env,
        "DJANGO_SETTINGS_MODULE": "other_auto_field_settings",
        "PYTHONPATH": f"{tmp_path}:{subprocess_env['PYTHONPATH']}",
    }
    result = subprocess.run(
        [sys.executable, "-m", "django", "makemigrations", "django_idempotency",
         "--check", "--dry-run"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No changes detected" in result.stdout


@pytest.mark.django_db
def test_records_table_is_range_partitioned_on_created_at_without_a_default() -> None:
    row = fetch_one(
        "SELECT c.relkind, p.partstrat, a.attname, p.partdefid "
        "FROM pg_class c JOIN pg_partitioned_table p ON p.partrelid = c.oid "
        "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = p.partattrs[0] "
        "WHERE c.oid = 'django_idempotency_record'::regclass"
    )
    assert row == ("p", "r", "created_at", 0)


@pytest.mark.django_db
def test_primary_key_is_id_and_created_at_in_the_database() -> None:
    row = fetch_one(
        "SELECT array_agg(a.attname::text ORDER BY k.ord) "
        "FROM pg_constraint con "
        "CROSS JOIN LATERAL unnest(con.conkey) WITH ORDINALITY AS k(attnum, ord) "
        "JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.attnum "
        "WHERE con.conrelid = 'django_idempotency_record'::regclass AND con.contype = 'p'"
    )
    assert row == (["id", "created_at"],)


@pytest.mark.django_db
def test_claim_function_and_key_scope_index_exist() -> None:
    assert fetch_one("SELECT to_regproc('django_idempotency_claim')::text") == (
        "django_idempotency_claim",
    )
    assert fetch_one("SELECT to_regclass('idempotency_key_scope')::text") == (
        "idempotency_key_scope",
    )


def _claim_a_new_key() -> None:
    assert claim("anonymous", new_key()).outcome == Outcome.WON


def _look_up_a_new_key() -> None:
    window = timedelta(days=1)
    assert records.lookup("default", principal="anonymous", key=new_key(), window=window) is None


@pytest.mark.django_db
@pytest.mark.parametrize("call", [_claim_a_new_key, _look_up_a_new_key], ids=["claim", "lookup"])
def test_the_functions_read_only_the_partitions_their_window_can_hold(call: Any) -> None:
    # auto_explain shows the plans run inside the functions; LOG goes to the client.
    plans: list[str] = []
    connection.ensure_connection()
    pgconn = connection.connection

    def keep(notice: Any) -> None:
        plans.append(notice.message_primary or "")

    # The database's day, read before the lookup runs on its clock: a midnight UTC passed
    # in between moves the window a day on, still inside the one computed here.
    today = catalog.database_now(connection).date()
    pgconn.add_notice_handler(keep)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            try:
                with transaction.atomic():
                    cursor.execute("LOAD 'auto_explain'")
            except DatabaseError:
                pytest.skip("the server has no auto_explain")
            for setting, value in (
                ("auto_explain.log_min_duration", "0"),
                ("auto_explain.log_nested_statements", "on"),
                ("auto_explain.log_analyze", "on"),
                ("auto_explain.log_timing", "off"),
                ("client_min_messages", "log"),
            ):
                cursor.execute("SELECT set_config(%s, %s, true)", [setting, value])
            call()
    finally:
        pgconn.remove_notice_handler(keep)
    (lookup,) = [plan for plan in plans if "FROM django_idempotency_record r" in plan]
    scanned = set(re.findall(r" on (django_idempotency_record_p\d{8}) ", lookup))
    # The window is a day: yesterday's partition and today's, never the week ahead.
    window = {RECORDS.partition_name(today + timedelta(days=n)) for n in (-1, 0, 1)}
    assert scanned and scanned <= window, lookup


@pytest.mark.django_db
def test_the_lookup_keeps_one_generic_plan() -> None:
    config = "SELECT proconfig FROM pg_proc WHERE proname = 'django_idempotency_lookup'"
    assert fetch_one(config) == (["plan_cache_mode=force_generic_plan"],)


@pytest.mark.django_db
def test_the_claim_keeps_one_generic_plan() -> None:
    config = "SELECT proconfig FROM pg_proc WHERE oid = 'django_idempotency_claim'::regproc"
    assert fetch_one(config) == (["plan_cache_mode=force_generic_plan"],)


def function_body(sql: str) -> str:
    """The plpgsql body of a ``CREATE FUNCTION`` statement."""
    return sql.split("AS $$", 1)[1].rsplit("$$", 1)[0]


MIGRATION = importlib.import_module("django_idempotency.migrations.0001_initial")


@pytest.mark.django_db(transaction=True)
def test_the_claim_is_the_migrations_and_refuses_repeatable_read() -> None:
    source = "SELECT prosrc FROM pg_proc WHERE oid = 'django_idempotency_claim'::regproc"
    assert fetch_one(source) == (function_body(MIGRATION.CLAIM_FUNCTION),)
    with pytest.raises(records.IsolationRefused), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        claim("anonymous", new_key())


def assert_migrated_schema_works() -> None:
    attached = {p.name for p in catalog.list_partitions(connection, RECORDS) if p.attached}
    # The migration ran on the database's day, today or (midnight UTC passed since)
    # yesterday.
    today = catalog.database_now(connection).date()
    (migrated_on,) = [
        day
        for day in (today, today - timedelta(days=1))
        if RECORDS.partition_name(day + timedelta(days=7)) in attached
    ][:1]
    for offset in range(-1, 8):
        name = RECORDS.partition_name(migrated_on + timedelta(days=offset))
        assert name in attached
        assert fetch_one("SELECT obj_description(%s::regclass, 'pg_class')", [name]) == (
            catalog.PARTITION_COMMENT,
        )
    key = new_key()
    with transaction.atomic():
        store_first("anonymous", key, claim("anonymous", key), ttl=timedelta(hours=1))
    with transaction.atomic():
        assert claim("anonymous", key).outcome == Outcome.FOUND


@pytest.mark.django_db(transaction=True)
def test_migrate_to_zero_and_back() -> None:
    IdempotencyRecordFactory()
    call_command("migrate", "django_idempotency", "zero", verbosity=0)
    assert fetch_one("SELECT to_regclass('django_idempotency_record')") == (None,)
    assert fetch_one("SELECT to_regproc('django_idempotency_claim')") == (None,)
    assert fetch_one(
        "SELECT count(*) FROM pg_class WHERE relname LIKE 'django\\_idempotency\\_record\\_p%%'"
    ) == (0,)

    call_command("migrate", "django_idempotency", verbosity=0)
    relkind = "SELECT relkind FROM pg_class WHERE oid = 'django_idempotency_record'::regclass"
    assert fetch_one(relkind) == ("p",)
    assert_migrated_schema_works()


@pytest.mark.django_db(transaction=True)
def test_the_secret_and_the_lock_function_go_and_come_back_with_a_new_secret() -> None:
    (before,) = fetch_one("SELECT secret FROM django_idempotency_secret") or (None,)
    call_command("migrate", "django_idempotency", "zero", verbosity=0)
    try:
        assert fetch_one("SELECT to_regclass('django_idempotency_secret')") == (None,)
        assert fetch_one("SELECT to_regproc('django_idempotency_lock_all')") == (None,)
    finally:
        call_command("migrate", "django_idempotency", verbosity=0)
    (after,) = fetch_one("SELECT secret FROM django_idempotency_secret") or (None,)
    assert isinstance(after, str) and len(after) == 64 and after != before
    assert fetch_one("SELECT to_regproc('django_idempotency_lock_all')") == (
        "django_idempotency_lock_all",
    )


def body_compressions() -> set[tuple[str, str]]:
    """(table, attcompression) of the records' body column: the parent and each partition."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attrelid::regclass::text, attcompression::text FROM pg_attribute "
            "WHERE attname = 'response_body' AND attrelid IN ("
            "  SELECT 'django_idempotency_record'::regclass UNION ALL "
            "  SELECT inhrelid FROM pg_inherits "
            "  WHERE inhparent = 'django_idempotency_record'::regclass)"
        )
        return set(cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_bodies_are_left_to_lz4_where_the_server_has_it_in_every_partition() -> None:
    (has_lz4,) = fetch_one(
        "SELECT 'lz4' = ANY (enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
    ) or (None,)
    lz4 = "l" if has_lz4 else ""
    day = catalog.utc_today() + timedelta(days=40)
    assert apply.create_partition(connection, RECORDS, day, retry_for=timedelta(seconds=5))
    try:
        # A partition made by maintenance follows the parent, as the migration's do.
        assert {compression for _, compression in body_compressions()} == {lz4}
        assert RECORDS.partition_name(day) in {table for table, _ in body_compressions()}
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP TABLE "{RECORDS.partition_name(day)}"')
    # The migration's own partitions, made anew.
    call_command("migrate", "django_idempotency", "zero", verbosity=0)
    call_command("migrate", "django_idempotency", verbosity=0)
    assert len(body_compressions()) == 10  # the parent and 9 days
    assert {compression for _, compression in body_compressions()} == {lz4}
