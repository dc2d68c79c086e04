"""The Celery task as a function (``apply()``), and the package without Celery installed.

A real worker and broker: ``test_celery_worker.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from django_idempotency.partitions.maintain import MaintenanceFailed

# Celery (the celery extra) is optional: without it these tests skip.
pytest.importorskip("celery")
from celery import Celery
from celery.beat import PersistentScheduler

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


def documented_beat_schedule() -> dict[str, Any]:
    """``CELERY_BEAT_SCHEDULE`` as docs/partitions.md shows it for Celery's own scheduler."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "partitions.md").read_text()
    section = page.split("### With Celery's own beat schedule", 1)[1].split("\n### ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    schedule: dict[str, Any] = namespace["CELERY_BEAT_SCHEDULE"]
    return schedule


@pytest.mark.usefixtures("partition_sandbox")
def test_the_documented_celery_beat_schedule_runs_the_real_task_hourly(tmp_path: Path) -> None:
    # Django 6.1 has no django-celery-beat: the docs schedule the task in Celery's own beat
    # schedule. Build it as `celery -A myproject beat` does, with the app of deployment.md.
    with override_settings(CELERY_BEAT_SCHEDULE=documented_beat_schedule()):
        app = Celery("myproject", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        # Eager: the entry's task runs here instead of waiting for a worker.
        app.conf.task_always_eager = True
        scheduler = PersistentScheduler(
            app=app, schedule_filename=str(tmp_path / "celerybeat-schedule")
        )
    try:
        (entry,) = [e for e in scheduler.schedule.values() if not e.name.startswith("celery.")]
        # A name Celery does not know would be sent to the broker and fail on a worker.
        assert entry.task == maintain_partitions.name and entry.task in app.tasks
        assert entry.schedule.minute == {17} and entry.schedule.hour == set(range(24))
        missing = today() + timedelta(days=3)
        detach_and_drop(missing)
        result = scheduler.apply_async(entry, advance=False)
        assert result.get()["created"] == [partition_name(missing)]
    finally:
        scheduler.close()


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
# The Celery glue: the task module, the Celery task bases (exactly-once, outbox) and the relay's
# publish path (imported when the relay publishes).
celery_only = {
    "django_idempotency.tasks",
    "django_idempotency.messaging.consumers.celery",
    "django_idempotency.messaging.consumers",  # its face, as old projects import it
    "django_idempotency.messaging.outbox_task",
    "django_idempotency.messaging.outbox.celery",
    "django_idempotency.messaging.destinations.celery_broker",
    "django_idempotency.messaging.destinations.celery",
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
