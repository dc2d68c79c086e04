"""System checks: each id is raised when it should be and only then, with a hint."""

from __future__ import annotations

import re
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.checks import CheckMessage, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import modify_settings, override_settings

from django_idempotency import checks
from django_idempotency.partitions import TABLE, partition_name
from tests.test_partitions import execute, today

pytestmark = pytest.mark.django_db


def partition_messages() -> list[CheckMessage]:
    return checks.check_partitions(None, databases=["default"])


def ids(messages: list[CheckMessage]) -> list[str]:
    return [message.id for message in messages if message.id]


def drop_future_partitions(keep: int) -> None:
    """Inside the test's transaction: rolled back afterwards."""
    for n in range(1 + keep, 5):
        name = partition_name(today() + timedelta(days=n))
        if not execute("SELECT to_regclass(%s)", [name])[0][0]:
            continue
        execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{name}"')
        execute(f'DROP TABLE "{name}"')


def test_a_healthy_table_raises_nothing() -> None:
    assert partition_messages() == []


def test_database_checks_only_run_when_asked_for_a_database() -> None:
    drop_future_partitions(keep=0)
    assert checks.check_partitions(None, databases=None) == []


def test_w101_fewer_than_two_future_partitions() -> None:
    drop_future_partitions(keep=2)
    assert partition_messages() == []
    drop_future_partitions(keep=1)
    (message,) = partition_messages()
    assert message.id == "django_idempotency.W101"
    assert "Only 1 future partitions" in message.msg
    assert "idempotency_partitions" in message.hint


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


@override_settings(IDEMPOTENCY_BEAT_REGISTER=True, IDEMPOTENCY_BEAT_CRONTAB="hourly")
def test_e001_malformed_crontab() -> None:
    (message,) = checks.check_beat(None)
    assert message.id == "django_idempotency.E001"
    assert "expected 5 fields" in message.msg and "17 * * * *" in message.hint


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
    source = Path(checks.__file__).read_text()
    found = re.findall(r'id="(django_idempotency\.[EW]\d{3})"', source)
    assert sorted(found) == sorted(set(found))
    assert set(found) == {
        "django_idempotency.E001",
        "django_idempotency.W001",
        "django_idempotency.W101",
        "django_idempotency.W102",
        "django_idempotency.W103",
    }
