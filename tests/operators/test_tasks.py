"""The Celery task as a function (``apply()``), and the package without Celery installed.

A real worker and broker: ``test_celery_worker.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection

from django_idempotency.partitions.maintain import MaintenanceFailed

# Celery and django-celery-beat are an optional extra: without them these tests skip.
pytest.importorskip("celery")
from django_idempotency.tasks import maintain_partitions
from tests.support.partitions import (
    detach_and_drop,
    execute,
    partition_name,
    today,
)


def test_the_task_name_is_stable() -> None:
    # Beat rows and other projects' send_task() calls refer to it by this string.
    assert maintain_partitions.name == "django_idempotency.maintain_partitions"


@pytest.mark.usefixtures("partition_sandbox")
def test_the_task_runs_maintenance_and_returns_a_json_report() -> None:
    missing = today() + timedelta(days=3)
    detach_and_drop(missing)
    result = maintain_partitions.apply()
    report: dict[str, Any] = result.get()
    assert report["created"] == [partition_name(missing)]
    assert report["using"] == "default" and report["future_partitions"] == 7
    assert json.loads(json.dumps(report)) == report


@pytest.mark.usefixtures("partition_sandbox")
def test_the_task_dry_run_changes_nothing() -> None:
    missing = today() + timedelta(days=3)
    detach_and_drop(missing)
    report = maintain_partitions.apply(kwargs={"dry_run": True}).get()
    assert report["dry_run"] and report["created"] == []
    assert any(partition_name(missing) in line for line in report["plan"])
    assert not execute("SELECT to_regclass(%s)", [partition_name(missing)])[0][0]


@pytest.mark.usefixtures("partition_sandbox")
def test_the_task_fails_when_a_step_fails() -> None:
    taken = today() + timedelta(days=3)
    detach_and_drop(taken)
    execute(f'CREATE TABLE "{partition_name(taken)}" (note text)')
    result = maintain_partitions.apply()
    assert result.failed()
    assert isinstance(result.result, MaintenanceFailed)
    assert "not a partition" in str(result.result)
    # Rebuilt from its message, as a result backend does.
    assert str(MaintenanceFailed(*result.result.args)) == str(result.result)
    assert connection.is_usable()


PROBE = """
import importlib, pkgutil, sys
sys.modules["celery"] = None  # any "import celery" now raises ImportError
sys.modules["django_celery_beat"] = None
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                    "django.contrib.sessions", "django.contrib.messages", "rest_framework",
                    "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True, IDEMPOTENCY_BEAT_REGISTER=True,
)
import django
django.setup()
import django_idempotency
# The Celery glue: the task module, the exactly-once consumers' base class and the relay's
# publish path (imported when the relay publishes).
celery_only = {
    "django_idempotency.tasks",
    "django_idempotency.messaging.consumers",
    "django_idempotency.messaging.publishing",
}
for module in pkgutil.walk_packages(django_idempotency.__path__, "django_idempotency."):
    if module.name not in celery_only:
        importlib.import_module(module.name)
assert "django_idempotency.tasks" not in sys.modules
from django.core.management import call_command, CommandError
call_command("migrate", verbosity=0)
from django.core.checks import run_checks
ids = [message.id for message in run_checks()]
print("W001" if "django_idempotency.W001" in ids else f"no W001 in {ids}")
try:
    call_command("idempotency_install_schedule")
except CommandError as exc:
    print("install_schedule:", exc)
call_command("idempotency_partitions")
"""


def test_the_package_works_without_celery_and_never_imports_the_task_module() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "W001"
    assert lines[1].startswith("install_schedule: django_celery_beat is not in INSTALLED_APPS")
    assert "default: django_idempotency_record not partitioned; deleted 0 expired rows" in lines[2:]
