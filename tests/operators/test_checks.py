"""System checks: each id is raised when it should be and only then, with a hint."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.core.checks import CheckMessage, Error, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import modify_settings, override_settings

from django_idempotency import checks
from django_idempotency import conf as conf_module
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.storage import bodies
from tests.support.partitions import detach_and_drop, execute, today

ROOT = Path(__file__).resolve().parents[2]
TABLE = RECORDS.table

# The database's clock frozen, its partitions as the migration made them that day.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("database_clock")]


def partition_messages() -> list[CheckMessage]:
    return checks.check_partitions(None, databases=["default"])


def ids(messages: list[CheckMessage]) -> list[str]:
    return [message.id for message in messages if message.id]


def drop_future_partitions(keep: int) -> None:
    """Inside the test's transaction: rolled back afterwards."""
    for n in range(1 + keep, 8):
        name = RECORDS.partition_name(today() + timedelta(days=n))
        if not execute("SELECT to_regclass(%s)", [name])[0][0]:
            continue
        execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{name}"')
        execute(f'DROP TABLE "{name}"')


def test_a_healthy_table_raises_nothing() -> None:
    assert partition_messages() == []


def test_database_checks_only_run_when_asked_for_a_database() -> None:
    drop_future_partitions(keep=0)
    assert checks.check_partitions(None, databases=None) == []


def test_w101_a_day_short_of_the_headroom_that_maintenance_keeps() -> None:
    # IDEMPOTENCY_PARTITIONS_AHEAD is 7: between midnight and the next hourly run, 6 is normal.
    drop_future_partitions(keep=6)
    assert partition_messages() == []
    drop_future_partitions(keep=5)
    (message,) = partition_messages()
    assert message.id == "django_idempotency.W101"
    assert message.msg == (
        f"Only 5 future partitions of {TABLE} exist on database 'default' "
        "(IDEMPOTENCY_PARTITIONS_AHEAD is 7): partition maintenance is not running. Writes "
        "fail (503) in 6 days at most."
    )
    assert "idempotency_partitions" in message.hint


@override_settings(IDEMPOTENCY_PARTITIONS_AHEAD=2)
def test_w101_with_the_smallest_headroom_warns_when_one_future_partition_is_left() -> None:
    drop_future_partitions(keep=2)
    assert partition_messages() == []
    drop_future_partitions(keep=1)
    assert ids(partition_messages()) == ["django_idempotency.W101"]


def test_e101_no_partition_holds_the_current_time() -> None:
    detach_and_drop(today())
    (message,) = partition_messages()
    assert message.id == "django_idempotency.E101"
    assert isinstance(message, Error)
    assert message.msg.startswith(f"No partition of {TABLE} on database 'default' holds ")
    assert "idempotent requests answer 503" in message.msg
    assert "idempotency_partitions" in message.hint
    with pytest.raises(SystemCheckError, match=r"django_idempotency\.E101"):
        call_command("check", "--database", "default", stdout=StringIO())


def test_w102_table_not_partitioned() -> None:
    execute(f"ALTER TABLE {TABLE} RENAME TO partitioned_away")
    assert partition_messages() == []  # not migrated yet: nothing to say
    execute(f"CREATE TABLE {TABLE} (LIKE partitioned_away INCLUDING ALL)")
    (message,) = partition_messages()
    assert message.id == "django_idempotency.W102"
    assert "not partitioned" in message.msg and message.hint


def test_w103_default_partition() -> None:
    execute(f"CREATE TABLE {TABLE}_rest PARTITION OF {TABLE} DEFAULT")
    (message,) = partition_messages()
    assert message.id == "django_idempotency.W103"
    assert "DEFAULT partition" in message.msg and message.hint


# With django-celery-beat installed, as the beat extra brings it.
needs_beat = pytest.mark.skipif(
    importlib.util.find_spec("django_celery_beat") is None,
    reason="the beat extra is not installed",
)


@needs_beat
@override_settings(IDEMPOTENCY_BEAT_REGISTER=True)
def test_w001_beat_registration_without_django_celery_beat() -> None:
    assert checks.check_beat(None) == []
    with modify_settings(INSTALLED_APPS={"remove": "django_celery_beat"}):
        (message,) = checks.check_beat(None)
    assert message.id == "django_idempotency.W001"
    assert "cron" in message.hint


@modify_settings(INSTALLED_APPS={"remove": "django_celery_beat"})
def test_no_beat_check_unless_registration_is_asked_for() -> None:
    assert checks.check_beat(None) == []


@needs_beat
@override_settings(IDEMPOTENCY_BEAT_REGISTER=True, IDEMPOTENCY_BEAT_CRONTAB="hourly")
def test_e001_malformed_crontab() -> None:
    (message,) = checks.check_beat(None)
    assert message.id == "django_idempotency.E001"
    assert "expected 5 fields" in message.msg and "17 * * * *" in message.hint


@needs_beat
@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("61 * * * *", "the minute '61' (Invalid end range: 61 > 59)"),
        ("17 25 * * *", "the hour '25'"),
        ("17 * 0 * *", "the day-of-month '0'"),
        ("*/x * * * *", "the minute '*/x'"),
    ],
)
def test_e001_a_crontab_field_celerys_parser_refuses(spec: str, said: str) -> None:
    with override_settings(IDEMPOTENCY_BEAT_REGISTER=True, IDEMPOTENCY_BEAT_CRONTAB=spec):
        (message,) = checks.check_beat(None)
    assert message.id == "django_idempotency.E001"
    assert said in message.msg and "Celery cannot read" in message.msg
    assert "17 * * * *" in message.hint


@needs_beat
@override_settings(IDEMPOTENCY_BEAT_REGISTER=True, IDEMPOTENCY_BEAT_CRONTAB="*/15 1-5 * * mon-fri")
def test_a_crontab_celery_reads_passes() -> None:
    assert checks.check_beat(None) == []


def test_the_check_command_runs_the_database_checks() -> None:
    drop_future_partitions(keep=0)
    with pytest.raises(SystemCheckError, match=r"django_idempotency\.W101"):
        call_command("check", "--database", "default", "--fail-level", "WARNING", stderr=StringIO())
    # Without --database, database checks stay quiet (Django's convention).
    assert "django_idempotency.W101" not in ids(run_checks())


def test_checks_skip_other_apps() -> None:
    from django.apps import apps

    drop_future_partitions(keep=0)
    auth = [apps.get_app_config("auth")]
    assert checks.check_partitions(auth, databases=["default"]) == []


def test_check_ids_are_unique() -> None:
    modules = sorted(Path(checks.__file__).parent.glob("*.py"))
    source = "\n".join(module.read_text() for module in modules)
    found = re.findall(r'id="(django_idempotency\.[EW]\d{3})"', source)
    assert sorted(found) == sorted(set(found))
    assert set(found) == {
        "django_idempotency.E001",
        "django_idempotency.E002",
        "django_idempotency.E003",
        "django_idempotency.E004",
        "django_idempotency.E005",
        "django_idempotency.E006",
        "django_idempotency.E007",
        "django_idempotency.E008",
        "django_idempotency.E009",
        "django_idempotency.E010",
        "django_idempotency.E012",
        "django_idempotency.E011",
        "django_idempotency.E013",
        "django_idempotency.E014",
        "django_idempotency.E015",
        "django_idempotency.E016",
        "django_idempotency.E121",
        "django_idempotency.E122",
        "django_idempotency.W121",
        "django_idempotency.W001",
        "django_idempotency.W002",
        "django_idempotency.W003",
        "django_idempotency.E017",
        "django_idempotency.W005",
        "django_idempotency.W008",
        "django_idempotency.W009",
        "django_idempotency.W010",
        "django_idempotency.W020",
        "django_idempotency.E020",
        "django_idempotency.W021",
        "django_idempotency.W022",
        "django_idempotency.E101",
        "django_idempotency.W101",
        "django_idempotency.W102",
        "django_idempotency.W103",
        "django_idempotency.W120",
        "django_idempotency.W130",
        "django_idempotency.W131",
        "django_idempotency.W132",
    }


# Settings and the DATABASES setting (django_idempotency.E002-E009, W002, W003).


def setting_ids() -> list[str]:
    return ids(checks.check_settings(None))


def database_ids() -> list[str]:
    return ids(checks.check_databases(None))


def manage_py_check(tmp_path: Path, extra_settings: str, *args: str) -> str:
    """``manage.py check`` in a child process whose settings are the tests' plus
    ``extra_settings``: for DATABASES layouts a running test cannot switch to."""
    (tmp_path / "check_settings.py").write_text(
        "from tests.settings import *  # noqa\n" + extra_settings
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "check", *args],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "check_settings",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


def test_default_settings_and_databases_raise_nothing() -> None:
    assert setting_ids() == []
    assert database_ids() == []


@pytest.mark.parametrize("header", ["Idempotency Key", "Idempotency_Key", "", "Idempotency-Key:"])
def test_e002_header_that_is_no_header_name(header: str) -> None:
    with override_settings(IDEMPOTENCY_HEADER=header):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E002"
    assert repr(header) in message.msg and "Idempotency-Key" in message.hint


@override_settings(IDEMPOTENCY_HEADER="X-Request-Key")
def test_another_header_name_is_fine() -> None:
    assert setting_ids() == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TTL", timedelta(0)),
        ("MAX_TTL", timedelta(hours=-1)),
        ("EXPIRED_WINDOW", timedelta(seconds=-1)),
        ("WAIT", timedelta(seconds=-1)),
        ("PARTITION_GRACE", timedelta(minutes=-5)),
        ("DDL_LOCK_TIMEOUT", timedelta(0)),
    ],
)
def test_e003_duration_out_of_range(name: str, value: object) -> None:
    with override_settings(**{f"IDEMPOTENCY_{name}": value}):
        messages = checks.check_settings(None)
    assert ids(messages) == ["django_idempotency.E003"]
    assert f"IDEMPOTENCY_{name} is {value!r}" in messages[0].msg
    assert "timedelta" in messages[0].hint


@override_settings(
    IDEMPOTENCY_WAIT=timedelta(0),
    IDEMPOTENCY_MAX_WAIT=timedelta(0),
    IDEMPOTENCY_EXPIRED_WINDOW=timedelta(0),
)
def test_zero_waits_and_no_expired_window_are_fine() -> None:
    assert setting_ids() == []


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"IDEMPOTENCY_TTL": timedelta(hours=48)}, "IDEMPOTENCY_TTL (2 days, 0:00:00)"),
        (
            # With a waiter cap: a wait no request can take is another warning (W022).
            {"IDEMPOTENCY_WAIT": timedelta(seconds=30), "IDEMPOTENCY_MAX_WAITERS": 2},
            "IDEMPOTENCY_WAIT (0:00:30)",
        ),
    ],
)
def test_e004_a_default_beyond_its_maximum(overrides: dict[str, Any], named: str) -> None:
    with override_settings(**overrides):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E004"
    assert named in message.msg
    with override_settings(
        **overrides,
        IDEMPOTENCY_MAX_TTL=timedelta(days=7),
        IDEMPOTENCY_MAX_WAIT=timedelta(minutes=1),
    ):
        assert setting_ids() == []


def test_e005_unknown_error_format() -> None:
    with override_settings(IDEMPOTENCY_ERROR_FORMAT="json"):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E005"
    assert "'json'" in message.msg and '"stripe"' in message.hint
    with override_settings(IDEMPOTENCY_ERROR_FORMAT="stripe"):
        assert setting_ids() == []


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("myproject.errors.envelope", "cannot be imported"),
        ("django_idempotency.conf.KINDS", "is not callable"),
    ],
)
def test_e005_an_error_format_function_that_is_not_one(value: str, said: str) -> None:
    with override_settings(IDEMPOTENCY_ERROR_FORMAT=value):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E005"
    assert repr(value) in message.msg and said in message.msg
    assert "dotted path of a function" in message.hint


@pytest.mark.parametrize("value", ["tests.test_rest_framework.envelope", lambda error: {}])
def test_an_error_format_function_passes(value) -> None:
    with override_settings(IDEMPOTENCY_ERROR_FORMAT=value, IDEMPOTENCY_DRF_EXCEPTION_HANDLER=True):
        assert setting_ids() == []


@pytest.mark.parametrize(
    ("methods", "said"),
    [
        (["POST", "get"], ": GET."),
        (("PATCH", "HEAD", "OPTIONS"), ": HEAD, OPTIONS."),
    ],
)
def test_e006_methods_that_are_safe(methods: object, said: str) -> None:
    with override_settings(IDEMPOTENCY_METHODS=methods):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E006"
    assert said in message.msg


@override_settings(IDEMPOTENCY_METHODS=["post", "PUT", "DELETE"])
def test_unsafe_methods_in_any_case_are_fine() -> None:
    assert setting_ids() == []


@pytest.mark.parametrize(
    ("level", "said"),
    [("REPEATABLE_READ", "REPEATABLE READ"), ("SERIALIZABLE", "SERIALIZABLE")],
)
def test_e007_isolation_level_in_options_that_the_claim_refuses(
    monkeypatch, level: str, said: str
) -> None:
    from django.db import connection
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    options = {**connection.settings_dict.get("OPTIONS", {})}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    options["isolation_level"] = getattr(IsolationLevel, level)
    (message,) = checks.check_databases(None)
    assert message.id == "django_idempotency.E007"
    assert said in message.msg and "'isolation_level' in DATABASES['default']" in message.msg
    assert "READ COMMITTED" in message.hint and "isolation_level" in message.hint
    # Said once: the live check leaves a level set in OPTIONS to this one.
    assert ids(checks.check_isolation(None, databases=["default"])) == []


def test_e016_a_secret_key_that_is_not_the_records_databases() -> None:
    from django_idempotency.storage.secret import shared_secret

    with override_settings(IDEMPOTENCY_SECRET_KEY="a secret of this server's own"):
        (message,) = checks.check_secret(None, databases=["default"])
    assert message.id == "django_idempotency.E016"
    assert "IDEMPOTENCY_SECRET_KEY" in message.msg and "'default'" in message.msg
    assert "500 misconfigured" in message.msg
    assert "remove IDEMPOTENCY_SECRET_KEY" in message.hint
    # Unset, or the database's own: nothing to say.
    assert checks.check_secret(None, databases=["default"]) == []
    with override_settings(IDEMPOTENCY_SECRET_KEY=shared_secret("default")):
        assert checks.check_secret(None, databases=["default"]) == []


@pytest.mark.parametrize("level", ["READ_COMMITTED", "READ_UNCOMMITTED"])
def test_read_committed_in_options_is_fine(monkeypatch, level: str) -> None:
    # PostgreSQL runs READ UNCOMMITTED as READ COMMITTED.
    from django.db import connection
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    options = {**connection.settings_dict.get("OPTIONS", {})}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    options["isolation_level"] = getattr(IsolationLevel, level)
    assert database_ids() == []
    assert ids(checks.check_isolation(None, databases=["default"])) == []


@contextlib.contextmanager
def connection_settings_at(route: str, level: str) -> Iterator[str]:
    """Settings for ``DATABASES['default']`` whose connections start transactions at
    ``level``, set where ``route`` says; a private database or role, dropped after."""
    import psycopg
    from django.db import connection
    from psycopg import sql

    from testproject.database import database_url

    name = f"{connection.settings_dict['NAME']}_{route.replace(' ', '_')}"
    # For servers that ask a password over TCP (CI's PostgreSQL 15).
    password = secrets.token_hex(16)
    statements: dict[str, tuple[str, ...]] = {
        "alter database": (
            "CREATE DATABASE {name}",
            f"ALTER DATABASE {{name}} SET default_transaction_isolation = '{level}'",
        ),
        "alter role": (
            f"CREATE ROLE {{name}} LOGIN PASSWORD '{password}'",
            f"ALTER ROLE {{name}} SET default_transaction_isolation = '{level}'",
        ),
    }
    # libpq reads a space in an option's value escaped by a backslash.
    option = "-c default_transaction_isolation=" + level.replace(" ", "\\ ")
    settings = {
        "alter database": f"DATABASES['default']['NAME'] = {name!r}\n",
        "alter role": f"DATABASES['default'].update(USER={name!r}, PASSWORD={password!r})\n",
        "options": "DATABASES['default']['OPTIONS'] = "
        f"{{**DATABASES['default'].get('OPTIONS', {{}}), 'options': {option!r}}}\n",
    }[route]
    drop = {"alter database": "DROP DATABASE {name} WITH (FORCE)", "alter role": "DROP ROLE {name}"}
    with psycopg.connect(database_url(), autocommit=True) as conn:
        for statement in statements.get(route, ()):
            conn.execute(sql.SQL(statement).format(name=sql.Identifier(name)))
    try:
        yield settings
    finally:
        if route in drop:
            with psycopg.connect(database_url(), autocommit=True) as conn:
                conn.execute(sql.SQL(drop[route]).format(name=sql.Identifier(name)))


@pytest.mark.parametrize(
    ("route", "level", "said"),
    [
        ("alter database", "repeatable read", "ALTER DATABASE ... SET"),
        ("alter role", "repeatable read", "ALTER ROLE ... SET"),
        ("options", "serializable", "the connection's options"),
    ],
)
def test_e007_reads_the_level_a_live_connection_has(
    tmp_path: Path, route: str, level: str, said: str
) -> None:
    with connection_settings_at(route, level) as settings:
        output = manage_py_check(tmp_path, settings, "--database", "default")
        # Without --database Django runs no database check (migrate runs them all).
        without = manage_py_check(tmp_path, settings)
    assert "django_idempotency.E007" in output, output
    assert f"runs transactions at {level.upper()} (set by {said}" in output
    assert "django_idempotency.E007" not in without, without


@pytest.mark.parametrize("level", ["read committed", "read uncommitted"])
def test_e007_stays_silent_for_a_live_connection_at_read_committed(
    tmp_path: Path, level: str
) -> None:
    with connection_settings_at("alter role", level) as settings:
        output = manage_py_check(tmp_path, settings, "--database", "default")
    assert "django_idempotency.E007" not in output, output
    assert "System check identified no issues" in output or "WARNING" in output, output


@pytest.mark.parametrize(
    ("name", "value", "smallest"),
    [
        ("PARTITIONS_AHEAD", 1, 2),
        ("DELETE_BATCH_SIZE", 0, 1),
        ("COMPRESS_MIN_BYTES", -1, 0),
        ("OUTBOX_REDRIVE_LIMIT", -1, 0),
        ("MAX_WAITERS", -1, 0),
        ("SERVER_THREADS", 0, 1),
    ],
)
def test_e008_integer_out_of_range(name: str, value: object, smallest: int) -> None:
    with override_settings(**{f"IDEMPOTENCY_{name}": value}):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E008"
    assert message.msg == (
        f"IDEMPOTENCY_{name} is {value!r}; it must be an integer of at least {smallest}."
    )
    assert message.hint == f"Remove IDEMPOTENCY_{name} to use its default."


@pytest.mark.parametrize(
    ("principal", "said"),
    [
        ("tests.support.views.no_such_function", "cannot be imported"),
        ("tests.support.views.CALLS", "is not callable"),
    ],
)
def test_e009_principal_that_is_no_function(principal: object, said: str) -> None:
    with override_settings(IDEMPOTENCY_PRINCIPAL=principal):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E009"
    assert said in message.msg


@override_settings(IDEMPOTENCY_PRINCIPAL="tests.support.views.tenant_principal")
def test_a_principal_given_by_dotted_path_is_fine() -> None:
    assert setting_ids() == []


@pytest.mark.parametrize(
    ("display", "said"),
    [
        ("tests.support.views.no_such_function", "cannot be imported"),
        ("tests.support.views.CALLS", "is not callable"),
    ],
)
def test_e011_principal_display_that_is_no_function(display: object, said: str) -> None:
    with override_settings(IDEMPOTENCY_PRINCIPAL_DISPLAY=display):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E011"
    assert said in message.msg


@override_settings(IDEMPOTENCY_PRINCIPAL_DISPLAY="django_idempotency.admin.usernames")
def test_a_principal_display_given_by_dotted_path_is_fine() -> None:
    assert setting_ids() == []


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"IDEMPOTENCY_SECRET_KEY": b"bytes"}, "IDEMPOTENCY_SECRET_KEY is b'bytes' (bytes)"),
        ({"IDEMPOTENCY_SECRET_KEY_FALLBACKS": "old"}, "FALLBACKS is 'old' (str)"),
        ({"IDEMPOTENCY_SECRET_KEY_FALLBACKS": ["old", ""]}, "FALLBACKS is ['old', ''] (list)"),
        ({"IDEMPOTENCY_SECRET_KEY_FALLBACKS": [None]}, "FALLBACKS is [None] (list)"),
    ],
    ids=["key-bytes", "fallbacks-a-string", "fallbacks-with-an-empty-one", "fallbacks-none"],
)
def test_e013_secret_settings_of_the_wrong_type(settings: dict[str, object], said: str) -> None:
    # A str as the fallbacks would be read one character at a time: a lock per character.
    with override_settings(**settings):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E013"
    assert said in message.msg


@override_settings(IDEMPOTENCY_SECRET_KEY="new", IDEMPOTENCY_SECRET_KEY_FALLBACKS=("old",))
def test_a_secret_with_fallbacks_is_fine() -> None:
    assert setting_ids() == []


def test_w002_atomic_requests_on_another_database_than_the_records(tmp_path: Path) -> None:
    (tmp_path / "records_router.py").write_text(
        "class RecordsRouter:\n"
        "    def db_for_write(self, model, **hints):\n"
        "        return 'records' if model._meta.app_label == 'django_idempotency' else None\n"
    )
    output = manage_py_check(
        tmp_path,
        "DATABASES = {'default': {**DATABASES['default'], 'ATOMIC_REQUESTS': True},\n"
        "             'records': {**DATABASES['default']}}\n"
        "DATABASE_ROUTERS = ['records_router.RecordsRouter']\n",
    )
    assert "django_idempotency.W002" in output
    assert "ATOMIC_REQUESTS is on for database 'default'" in output


def test_atomic_requests_on_the_records_database_is_fine(monkeypatch) -> None:
    from django.db import connection

    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    assert database_ids() == []


def test_w003_records_on_a_database_without_partitions(tmp_path: Path) -> None:
    output = manage_py_check(
        tmp_path,
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(tmp_path / 'db.sqlite3')!r}}}}}\n",
    )
    assert "django_idempotency.W003" in output
    assert "SQLite" in output and "plain table" in output


def test_the_check_command_runs_the_settings_checks() -> None:
    with (
        override_settings(IDEMPOTENCY_ERROR_FORMAT="json"),
        pytest.raises(SystemCheckError, match=r"django_idempotency\.E005"),
    ):
        call_command("check", stderr=StringIO())


def routes_of(message: Any) -> str:
    """The routes a view message names: "The idempotent view /a/, /b/ (module.View) ..."."""
    return re.search(r"view (.+?) \(", message.msg)[1]  # type: ignore[index]


def routes_in(check_id: str) -> set[str]:
    """Every route that the URL checks name under ``check_id``."""
    return {
        route
        for m in checks.check_views(None)
        if m.id == check_id
        for route in routes_of(m).split(", ")
    }


@pytest.mark.urls("tests.support.urls")
def test_e017_an_idempotent_view_open_to_anonymous_clients_without_a_principal_callable() -> None:
    errors = [m for m in checks.check_views(None) if m.id == "django_idempotency.E017"]
    assert all(isinstance(m, Error) for m in errors)
    refused = routes_in("django_idempotency.E017")
    assert "/drf/identified/" in refused  # AllowAny, no principal callable, no opt-in
    assert "/drf/" not in refused  # AllowAny, allow_anonymous
    assert "/drf/guarded/" not in refused  # IsAuthenticated
    assert "/drf/tenant/" not in refused  # a principal callable
    assert "/drf/durable/" not in refused
    # A plain function view: nothing but Django's own view decorators above @idempotent.
    assert "/plain/identified/" in refused  # csrf_exempt only
    assert "/iban/above-token-required/" in refused  # its authentication runs after the claim
    assert "/plain/" not in refused  # allow_anonymous
    assert "/plain/tenant/" not in refused  # a principal callable
    assert "/plain/login/" not in refused  # login_required above
    assert "/iban/below-token-required/" not in refused  # its own authentication above


@pytest.mark.urls("tests.support.urls")
def test_e017_respects_login_required_middleware_and_login_not_required() -> None:
    from django.conf import settings
    from django.contrib.auth import decorators
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    from django_idempotency.decorators import idempotent

    login_not_required = getattr(decorators, "login_not_required", None)
    if login_not_required is None:
        pytest.skip("LoginRequiredMiddleware is new in Django 5.1")

    from tests.support import views

    middleware = [*settings.MIDDLEWARE, "django.contrib.auth.middleware.LoginRequiredMiddleware"]

    def plain() -> Any:  # login_not_required marks the function it is given
        return csrf_exempt(idempotent(views._plain))

    class URLs:
        urlpatterns = [
            path("guarded/", plain()),
            path("open/", login_not_required(plain())),
        ]

    with override_settings(MIDDLEWARE=middleware, ROOT_URLCONF=URLs):
        assert routes_in("django_idempotency.E017") == {"/open/"}


@pytest.mark.urls("tests.support.urls")
def test_w021_names_each_view_that_runs_a_key_anew_after_a_version_change() -> None:
    assert routes_in("django_idempotency.W021") == {"/drf/rerun-versions/"}
    (warning,) = [m for m in checks.check_views(None) if m.id == "django_idempotency.W021"]
    assert "(tests.support.views.GuardedView)" in warning.msg
    assert "rerun_other_versions" in warning.hint


@pytest.mark.urls("tests.support.urls")
def test_w005_an_idempotent_view_that_opens_a_durable_block() -> None:
    durable = [m for m in checks.check_views(None) if m.id == "django_idempotency.W005"]
    assert len(durable) == 1
    assert "/drf/durable/ (tests.support.views.DurableView)" in durable[0].msg


class RecordsNowhere:
    """Migrates nothing of django_idempotency: the records have no table anywhere."""

    def allow_migrate(self, db: str, app_label: str, **hints: object) -> bool | None:
        return False if app_label == "django_idempotency" else None


@pytest.mark.urls("tests.support.urls")
def test_e012_a_view_whose_writes_go_where_the_records_table_is_not_migrated() -> None:
    assert not [m for m in checks.check_records_follow_writes(None, databases=["default"])]
    with override_settings(DATABASE_ROUTERS=[RecordsNowhere()]):
        errors = checks.check_records_follow_writes(None, databases=["default"])
    assert {m.id for m in errors} == {"django_idempotency.E012"}
    assert any("/drf/groups/" in m.msg and "auth.Group" in m.msg for m in errors)


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=None)
def test_none_turns_the_redrive_off_and_is_no_error() -> None:
    assert checks.check_settings(None) == []


@override_settings(IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=timedelta(0))
def test_e003_says_when_none_is_allowed() -> None:
    (message,) = checks.check_settings(None)
    assert message.msg.endswith("it must be a positive timedelta, or None.")


# Settings of the wrong type (contract 15): one error each, naming the setting and its type,
# never a traceback; the table of types covers every setting.

WRONG_VALUES = {
    conf_module.TEXT: 42,
    conf_module.OPTIONAL_TEXT: 42,
    conf_module.TEXTS: "POST",
    conf_module.SECRETS: "old",
    conf_module.INTEGER: "100",
    conf_module.OPTIONAL_INTEGER: "100",
    conf_module.INTEGERS: "408",
    conf_module.BOOLEAN: "False",
    conf_module.DURATION: 3600,
    conf_module.OPTIONAL_DURATION: 600,
    conf_module.FUNCTION: 42,
    conf_module.OPTIONAL_FUNCTION: 42,
    conf_module.ERROR_FORMAT_KIND: 42,
    conf_module.MAPPING: [("default", "celery")],
}


def test_every_setting_has_an_expected_type() -> None:
    settings = {name for name, value in vars(conf_module.Settings).items()
                if isinstance(value, property)}  # fmt: skip
    assert set(conf_module.KINDS) == settings
    assert set(conf_module.REQUEST_SETTINGS) <= settings
    assert set(conf_module.KINDS.values()) <= set(WRONG_VALUES)


@pytest.mark.parametrize("name", sorted(conf_module.KINDS))
def test_e013_a_setting_of_the_wrong_type_is_one_error_naming_it_and_its_type(name: str) -> None:
    kind, value = conf_module.KINDS[name], WRONG_VALUES[conf_module.KINDS[name]]
    with override_settings(**{f"IDEMPOTENCY_{name}": value}):
        # Every check of the app, the URL and database ones too: none may raise.
        messages = run_checks(databases=["default"])
    errors = [m for m in messages if m.id.startswith("django_idempotency.") and m.is_serious()]
    assert ids(errors) == ["django_idempotency.E013"]
    assert errors[0].msg == (
        f"IDEMPOTENCY_{name} is {value!r} ({type(value).__name__}); it must be {kind.description}."
    )
    assert f"IDEMPOTENCY_{name}" in errors[0].hint


@pytest.mark.parametrize("value", [None, "tests.support.views.CALLS"])
def test_a_celery_app_path_that_imports_is_fine(value: object) -> None:
    with override_settings(IDEMPOTENCY_OUTBOX_CELERY_APP=value):
        assert setting_ids() == []


def test_e013_a_celery_app_path_that_cannot_be_imported() -> None:
    with override_settings(IDEMPOTENCY_OUTBOX_CELERY_APP="nowhere.celery.app"):
        (message,) = checks.check_settings(None)
    assert message.id == "django_idempotency.E013"
    assert "IDEMPOTENCY_OUTBOX_CELERY_APP 'nowhere.celery.app' cannot be imported" in message.msg


def test_manage_py_check_reports_settings_of_the_wrong_type_without_a_traceback(
    tmp_path: Path,
) -> None:
    output = manage_py_check(
        tmp_path,
        "IDEMPOTENCY_TTL = 3600\n"
        "IDEMPOTENCY_REQUIRED = 'yes'\n"
        "IDEMPOTENCY_PRINCIPAL = 'nowhere.principal'\n"
        "IDEMPOTENCY_OUTBOX_CELERY_APP = 'nowhere.celery.app'\n",
    )
    print(output)
    assert "Traceback" not in output
    assert "IDEMPOTENCY_TTL is 3600 (int); it must be a datetime.timedelta." in output
    assert "IDEMPOTENCY_REQUIRED is 'yes' (str); it must be True or False." in output
    assert "IDEMPOTENCY_PRINCIPAL 'nowhere.principal' cannot be imported" in output
    assert "IDEMPOTENCY_OUTBOX_CELERY_APP 'nowhere.celery.app' cannot be imported" in output
    assert output.count("django_idempotency.E013") == 3


# The URLconf's idempotent views, every style (contract 3: the anonymous-view check sees
# them all), and a decorator placed outside the view's authentication (E014).


@pytest.mark.urls("tests.support.urls")
def test_e017_sees_every_view_style_and_allow_anonymous_silences_it() -> None:
    warned = routes_in("django_idempotency.E017")
    assert "/drf/api-view/identified/" in warned  # @api_view with AllowAny
    assert "/drf/api-view/" not in warned  # ... with allow_anonymous=True
    assert "/drf/method-decorated/" in warned  # method_decorator on an AllowAny APIView
    assert "/drf/token-only/" in warned
    assert "/drf/anonymous-keys/" not in warned  # idempotency_allow_anonymous
    if importlib.util.find_spec("ninja"):
        assert "/ninja/open/" in warned  # an operation without auth
        assert "/ninja/anonymous-keys/" not in warned  # allow_anonymous=True
        assert "/ninja/session/" not in warned  # auth=django_auth
    assert "/iban/below-api-view/" not in warned  # IsAuthenticated


@pytest.mark.urls("tests.support.urls")
def test_e014_idempotent_outside_the_views_own_authentication() -> None:
    errors = [m for m in checks.check_views(None) if m.id == "django_idempotency.E014"]
    assert [routes_of(m) for m in errors] == [
        "/iban/above-api-view/",  # above @api_view
        "/drf/dispatch-decorated/",  # method_decorator on an APIView's dispatch()
    ]
    assert "below @api_view" in errors[0].hint


# Settings the app does not know, and values outside their allowed set (W020, E020), and
# waiting that cannot wait (W022).


@pytest.mark.parametrize(
    ("name", "nearest"),
    [
        ("IDEMPOTENCY_REQUIRD", "IDEMPOTENCY_REQUIRED"),
        ("IDEMPOTENCY_METHOD", "IDEMPOTENCY_METHODS"),
        ("IDEMPOTENCY_MAX_WAITER", "IDEMPOTENCY_MAX_WAITERS"),
        ("IDEMPOTENCY_ENCRYPTION_KEY", "IDEMPOTENCY_ENCRYPTION_KEYS"),
        # Another package's setting, left behind by a migration: named, nothing guessed.
        ("IDEMPOTENCY_KEY_EXEMPT_PATH_RE", None),
    ],
)
def test_w020_an_unknown_setting_names_the_nearest_known_one(name: str, nearest: str) -> None:
    with override_settings(**{name: True}):
        (message,) = [m for m in checks.check_settings(None) if m.id == "django_idempotency.W020"]
    assert message.msg.startswith(f"{name} is not a setting of django-idempotency")
    if nearest:
        assert message.msg.endswith(f"Did you mean {nearest}?")
        assert f"Rename it to {nearest}" in message.hint
    else:
        assert "Did you mean" not in message.msg


def test_manage_py_check_warns_of_a_misspelt_setting(tmp_path: Path) -> None:
    output = manage_py_check(tmp_path, "IDEMPOTENCY_REQUIRD = True\n")
    assert "django_idempotency.W020" in output
    assert "did you mean idempotency_required?" in output.lower()


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ({"IDEMPOTENCY_METHODS": ["POST", "GETT"]}, "IDEMPOTENCY_METHODS ['GETT']"),
        ({"IDEMPOTENCY_METHODS": ("post", "CONNECT")}, "IDEMPOTENCY_METHODS ['CONNECT']"),
        ({"IDEMPOTENCY_UNSTORED_STATUSES": [429, 201]}, "IDEMPOTENCY_UNSTORED_STATUSES [201]"),
        ({"IDEMPOTENCY_UNSTORED_STATUSES": [4290]}, "IDEMPOTENCY_UNSTORED_STATUSES [4290]"),
        ({"IDEMPOTENCY_FINGERPRINT_HEADERS": ["X_Account"]}, "['X_Account']"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["X-Request Id"]}, "['X-Request Id']"),
        ({"IDEMPOTENCY_BODY_COMPRESSION": "gzip"}, "IDEMPOTENCY_BODY_COMPRESSION 'gzip'"),
    ],
)
def test_e020_a_value_outside_its_settings_allowed_set(overrides: dict, said: str) -> None:
    with override_settings(**overrides):
        errors = [m for m in checks.check_settings(None) if m.id == "django_idempotency.E020"]
    assert len(errors) == 1 and said in errors[0].msg
    assert isinstance(errors[0], Error) and errors[0].hint


def test_e020_zstd_named_where_it_cannot_be_imported_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(bodies, "zstd_codec", lambda: None)
    with override_settings(IDEMPOTENCY_BODY_COMPRESSION="zstd"):
        errors = [m for m in checks.check_settings(None) if m.id == "django_idempotency.E020"]
    assert len(errors) == 1 and "cannot import" in errors[0].msg
    assert "django-idempotency[zstd]" in errors[0].hint


def test_known_methods_statuses_and_headers_are_fine() -> None:
    with override_settings(
        IDEMPOTENCY_METHODS=["post", "PUT", "PATCH", "DELETE"],
        IDEMPOTENCY_BODY_COMPRESSION="zlib",
        IDEMPOTENCY_UNSTORED_STATUSES=[408, 409, 425, 429, 503],
        IDEMPOTENCY_FINGERPRINT_HEADERS=["X-Account"],
        IDEMPOTENCY_REPLAY_HEADERS=["X-Request-Id"],
    ):
        assert setting_ids() == []


@pytest.mark.parametrize(
    ("overrides", "env", "said"),
    [
        ({}, None, "IDEMPOTENCY_MAX_WAITERS is 0 (its default)"),
        ({"IDEMPOTENCY_MAX_WAITERS": 2}, "--workers 4", "one request thread (GUNICORN_CMD_ARGS)"),
    ],
)
def test_w022_a_wait_that_no_request_can_take(
    monkeypatch, overrides: dict, env: str | None, said: str
) -> None:
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    if env is not None:
        monkeypatch.setenv("GUNICORN_CMD_ARGS", env)
    with override_settings(IDEMPOTENCY_WAIT=timedelta(seconds=2), **overrides):
        (message,) = [m for m in checks.check_settings(None) if m.id == "django_idempotency.W022"]
    assert message.msg.startswith("IDEMPOTENCY_WAIT is 0:00:02, but ")
    assert said in message.msg
    assert "IDEMPOTENCY_MAX_WAITERS" in message.hint


@pytest.mark.parametrize(
    "overrides",
    [
        {"IDEMPOTENCY_WAIT": timedelta(seconds=2), "IDEMPOTENCY_MAX_WAITERS": 2},
        {"IDEMPOTENCY_WAIT": timedelta(seconds=2), "ASGI_APPLICATION": "testproject.asgi.app"},
        {"IDEMPOTENCY_MAX_WAITERS": 0},
    ],
    ids=["capped", "asgi", "no-wait"],
)
def test_waiting_with_what_it_needs_is_fine(monkeypatch, overrides: dict) -> None:
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    with override_settings(**overrides):
        assert "django_idempotency.W022" not in setting_ids()


# The server shape (django_idempotency.W008, W009).


def server_ids() -> list[str]:
    return ids(checks.check_servers(None))


@pytest.mark.parametrize(
    ("overrides", "env", "threads", "source"),
    [
        (
            {"IDEMPOTENCY_MAX_WAITERS": 4, "IDEMPOTENCY_SERVER_THREADS": 4},
            None,
            4,
            "IDEMPOTENCY_SERVER_THREADS",
        ),
        (
            {"IDEMPOTENCY_MAX_WAITERS": 8, "IDEMPOTENCY_SERVER_THREADS": 4},
            None,
            4,
            "IDEMPOTENCY_SERVER_THREADS",
        ),
        ({"IDEMPOTENCY_MAX_WAITERS": 4}, "-w 4 --threads 4", 4, "GUNICORN_CMD_ARGS"),
        ({"IDEMPOTENCY_MAX_WAITERS": 4}, "-w 4 --threads=2", 2, "GUNICORN_CMD_ARGS"),
        # gunicorn's sync worker: one thread.
        ({"IDEMPOTENCY_MAX_WAITERS": 1}, "--workers 4", 1, "GUNICORN_CMD_ARGS"),
    ],
    ids=[
        "cap-equals-threads",
        "cap-above-threads",
        "gunicorn-args",
        "gunicorn-args-eq",
        "sync-worker",
    ],
)
def test_w008_a_waiter_cap_that_cannot_leave_a_thread_free(
    monkeypatch, overrides: dict[str, int], env: str | None, threads: int, source: str
) -> None:
    if env is not None:
        monkeypatch.setenv("GUNICORN_CMD_ARGS", env)
    with override_settings(**overrides):
        (message,) = checks.check_servers(None)
    assert message.id == "django_idempotency.W008"
    cap = overrides["IDEMPOTENCY_MAX_WAITERS"]
    assert message.msg.startswith(
        f"IDEMPOTENCY_MAX_WAITERS is {cap}, but a server process has {threads} request "
        f"thread(s) ({source})"
    )
    assert f"Set IDEMPOTENCY_MAX_WAITERS to {threads - 1} or fewer" in message.hint


@pytest.mark.parametrize(
    ("overrides", "env"),
    [
        ({}, "--threads 4"),  # the default cap: no request waits on a thread
        ({"IDEMPOTENCY_MAX_WAITERS": 3, "IDEMPOTENCY_SERVER_THREADS": 4}, None),
        ({"IDEMPOTENCY_MAX_WAITERS": 2}, "-w 4 --threads 4"),
        # Nothing says how many threads there are.
        ({"IDEMPOTENCY_MAX_WAITERS": 4}, None),
    ],
)
def test_a_waiter_cap_below_the_thread_count_is_fine(
    monkeypatch, overrides: dict[str, int], env: str | None
) -> None:
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    if env is not None:
        monkeypatch.setenv("GUNICORN_CMD_ARGS", env)
    with override_settings(**overrides):
        assert server_ids() == []


GUNICORN_BIN = "/srv/venv/bin/gunicorn"
GUNICORN_MAIN = "/srv/venv/lib/python3.12/site-packages/gunicorn/__main__.py"


@pytest.mark.parametrize(
    ("argv", "env", "config", "threads", "source"),
    [
        ([GUNICORN_BIN, "app.wsgi", "--threads", "4"], None, None, 4, "gunicorn's command line"),
        ([GUNICORN_MAIN, "--threads=4", "app.wsgi"], None, None, 4, "gunicorn's command line"),
        # gunicorn's own parser: an abbreviation it accepts, and the command line over the
        # environment.
        ([GUNICORN_BIN, "--thread", "4", "app.wsgi"], "--threads 2", None, 4, "command line"),
        ([GUNICORN_BIN, "app.wsgi"], "--threads 4", "threads = 2\n", 4, "GUNICORN_CMD_ARGS"),
        ([GUNICORN_BIN, "app.wsgi"], None, "workers = 2\nthreads = 4\n", 4, "gunicorn.conf.py"),
        (
            [GUNICORN_BIN, "-c", "deploy/gunicorn.py", "app.wsgi"],
            None,
            "threads = 4\n",
            4,
            "deploy/gunicorn.py",
        ),
        # A check run beside the config file gunicorn will read.
        (["manage.py", "check"], None, "threads = 4\n", 4, "gunicorn.conf.py"),
        # gunicorn's sync worker, started without --threads: one thread.
        ([GUNICORN_BIN, "-w", "4", "app.wsgi"], None, None, 1, "gunicorn's command line"),
    ],
    ids=["cli", "cli-eq-module", "abbreviated", "env", "conf", "conf-flag", "check", "sync"],
)
def test_w008_reads_the_thread_count_wherever_gunicorn_takes_it(
    monkeypatch, tmp_path: Path, argv, env, config, threads: int, source: str
) -> None:
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    if env is not None:
        monkeypatch.setenv("GUNICORN_CMD_ARGS", env)
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(tmp_path)
    if config is not None:
        name = argv[2] if "-c" in argv else "gunicorn.conf.py"
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(config)
    with override_settings(IDEMPOTENCY_MAX_WAITERS=threads):
        (message,) = checks.check_servers(None)
    assert message.id == "django_idempotency.W008"
    assert f"a server process has {threads} request thread(s) (" in message.msg
    assert source in message.msg


def test_at_run_time_the_waiter_cap_stays_below_gunicorns_command_line_threads(
    monkeypatch, tmp_path: Path
) -> None:
    from django_idempotency.engine import waiting

    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [GUNICORN_BIN, "--threads", "4", "app.wsgi"])
    monkeypatch.setattr(waiting.threading, "main_thread", lambda: None)  # a gthread worker
    with override_settings(IDEMPOTENCY_MAX_WAITERS=4):
        assert waiting.waiter_limit() == 3


def test_a_config_file_whose_threads_cannot_be_read_without_running_it_is_not_guessed(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["manage.py", "check"])
    (tmp_path / "gunicorn.conf.py").write_text("import os\nthreads = os.cpu_count() * 2\n")
    with override_settings(IDEMPOTENCY_MAX_WAITERS=4):
        assert server_ids() == []


def test_w009_persistent_connections_under_asgi(monkeypatch) -> None:
    from django.db import connection

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 600)
    with override_settings(ASGI_APPLICATION="testproject.asgi.application"):
        (message,) = checks.check_servers(None)
    assert message.id == "django_idempotency.W009"
    assert message.msg.startswith(
        "Database 'default' keeps connections open (CONN_MAX_AGE = 600) and the project "
        "runs under ASGI"
    )
    assert "['pool']" in message.hint and "CONN_MAX_AGE = 0" in message.hint


@pytest.mark.parametrize(
    ("asgi", "age", "options"),
    [
        (True, 0, {}),
        (True, 0, {"pool": {"max_size": 10}}),
        (True, None, {"pool": True}),  # Django's pool keeps connections itself
        (False, 600, {}),  # WSGI: one connection per worker thread, reused
    ],
)
def test_bounded_connections_under_asgi_are_fine(
    monkeypatch, asgi: bool, age: int | None, options: dict[str, object]
) -> None:
    from django.db import connection

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", age)
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    with override_settings(ASGI_APPLICATION="testproject.asgi.application" if asgi else None):
        assert server_ids() == []


def test_the_test_project_under_asgi_uses_a_bounded_pool() -> None:
    script = (
        "import django; django.setup()\n"
        "from django.conf import settings\n"
        "from django.core.checks import run_checks\n"
        "database = settings.DATABASES['default']\n"
        "print(settings.ASGI_APPLICATION, database['CONN_MAX_AGE'],"
        " database['OPTIONS']['pool']['max_size'])\n"
        "print(sorted(m.id for m in run_checks() if m.id))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        # What testproject/asgi.py sets before the settings load.
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings", "DJANGO_ASGI": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    declared, found = done.stdout.splitlines()
    assert declared == "testproject.asgi.application 0 10"
    assert "django_idempotency.W009" not in found


@pytest.mark.urls("tests.support.router_urls")
def test_e017_once_for_a_viewset_naming_its_routes_without_regex_escapes() -> None:
    from django_idempotency.http.endpoints import idempotent_endpoints

    routes = [endpoint.route for endpoint in idempotent_endpoints()]
    (warning,) = [m for m in checks.check_views(None) if m.id == "django_idempotency.E017"]

    assert "/groups.<format>/" in routes and "/groups/<pk>.<format>/" in routes
    assert not [route for route in routes if "\\" in route]
    assert routes_of(warning).split(", ") == list(dict.fromkeys(routes))
    assert "(tests.support.router_urls.OpenGroupViewSet)" in warning.msg


# Stored responses at rest (django_idempotency.E015, W010).

KEY = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="  # 32 bytes, for the checks only


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        (["not base64!"], r"IDEMPOTENCY_ENCRYPTION_KEYS\[0\] is not base64"),
        ([KEY, "c2hvcnQ="], r"\[1\] decodes to 5 bytes; it must be 32"),
        ([KEY, KEY], r"\[0\] and \[1\] have the same key id"),
    ],
)
def test_e015_an_encryption_key_that_cannot_seal(keys: list[str], said: str) -> None:
    with override_settings(IDEMPOTENCY_ENCRYPTION_KEYS=keys):
        messages = checks.check_keys(None)
    assert ids(messages) == ["django_idempotency.E015"]
    assert re.search(said, messages[0].msg)
    assert "no response is ever stored in plain text" in messages[0].msg
    assert KEY not in messages[0].msg


def test_well_formed_encryption_keys_are_fine_and_silence_w010() -> None:
    with override_settings(IDEMPOTENCY_ENCRYPTION_KEYS=[KEY]):
        assert checks.check_keys(None) == []
        assert checks.check_plain_text(None) == []


def test_w010_plain_text_at_rest_is_a_deployment_warning() -> None:
    assert ids(checks.check_plain_text(None)) == ["django_idempotency.W010"]
    out = StringIO()
    call_command("check", "--deploy", stdout=out, stderr=out)
    assert "django_idempotency.W010" in out.getvalue()
    plain = StringIO()
    call_command("check", stdout=plain, stderr=plain)
    assert "W010" not in plain.getvalue()


# E121: the relay's destinations, checked without connecting.

NATS_BACKEND = "django_idempotency.messaging.destinations.nats.NatsDestination"
CELERY_BACKEND = "django_idempotency.messaging.destinations.celery.CeleryDestination"


NATS_OPTIONS = {"BACKEND": NATS_BACKEND, "OPTIONS": {"server": "x"}}
NATS_SUBJECT = {"BACKEND": NATS_BACKEND, "OPTIONS": {"subject": "{topic}"}}
CELERY_OPTIONS = {"BACKEND": CELERY_BACKEND, "OPTIONS": {"broker": "x"}}


@pytest.mark.parametrize(
    ("destinations", "routes", "says"),
    [
        ({"stream": {"BACKEND": NATS_BACKEND}}, {}, "no 'default' destination"),
        ({"default": {"BACKEND": CELERY_BACKEND}}, {"event:*": "stream"}, "destination 'stream'"),
        ({"default": {"BACKEND": "no_such_client.Destination"}}, {}, "'no_such_client'"),
        ({"default": "celery"}, {}, 'it must be a dict with a "BACKEND"'),
        ({"default": NATS_OPTIONS}, {}, "unknown OPTIONS ['server']"),
        ({"default": NATS_SUBJECT}, {}, "unknown field"),
        ({"default": CELERY_OPTIONS}, {}, "unknown OPTIONS ['broker']"),
        # A class that does not derive from the declared contract (here, no destination).
        ({"default": {"BACKEND": "collections.OrderedDict"}}, {}, "is no subclass of"),
    ],
)
def test_e121_a_destination_that_cannot_be_made_is_one_error_saying_why(
    destinations: dict[str, Any], routes: dict[str, str], says: str
) -> None:
    with override_settings(
        IDEMPOTENCY_OUTBOX_DESTINATIONS=destinations, IDEMPOTENCY_OUTBOX_ROUTES=routes
    ):
        (error,) = checks.check_destinations(None)
    assert error.id == "django_idempotency.E121" and says in error.msg, error.msg


def test_e121_a_missing_client_library_names_the_extra_to_install() -> None:
    with (
        mock.patch.dict(sys.modules, {"nats": None}),
        override_settings(IDEMPOTENCY_OUTBOX_DESTINATIONS={"default": {"BACKEND": NATS_BACKEND}}),
    ):
        sys.modules.pop("django_idempotency.messaging.destinations.nats", None)
        (error,) = checks.check_destinations(None)
    sys.modules.pop("django_idempotency.messaging.destinations.nats", None)
    assert "the nats extra: django-idempotency[nats]" in error.msg


def test_destinations_and_routes_that_can_be_made_pass() -> None:
    with override_settings(
        IDEMPOTENCY_OUTBOX_DESTINATIONS={
            "default": {"BACKEND": CELERY_BACKEND},
            "stream": {"BACKEND": NATS_BACKEND, "OPTIONS": {"servers": "nats://h:4222"}},
        },
        IDEMPOTENCY_OUTBOX_ROUTES={"event:payments.*": "stream"},
    ):
        assert checks.check_destinations(None) == []
