"""Django's built-in Tasks framework (``django.tasks``, Django 6.0+) through the outbox, in a
process where nothing patches Django: no django-tasks backport (whose import calls
django_stubs_ext.monkeypatch(), making Django's Task subscriptable), no django-stubs-ext, no
typing_extensions, no Celery. The real backend is Django's own ImmediateBackend, so the relay's
hand-over runs ``task_runner.deliver`` in the relay's process. Issue 28: on Django 6.0/6.1 the
Tasks destination failed to import (``Task[..., Any]``), and every 6.x project's check imported
typing_extensions; the suite hid both, the backport being imported in its processes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("django.tasks") is None,
    reason="Django's Tasks framework is built in from Django 6.0",
)

PROBE = """
import sys
for name in ("django_tasks", "django_stubs_ext", "typing_extensions", "celery"):
    sys.modules[name] = None  # their import raises ImportError
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True,
    TASKS={
        "default": {
            "BACKEND": "django_idempotency.messaging.task_backend.OutboxBackend",
            "OPTIONS": {"backend": "immediate", "destination": "default"},
        },
        "immediate": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"},
    },
    IDEMPOTENCY_OUTBOX_DESTINATIONS={
        "default": {"BACKEND": "django_idempotency.messaging.destinations.tasks.TasksDestination"},
    },
)
import django
django.setup()
from django.core.checks import ERROR, run_checks
from django.core.management import call_command
from django.db import transaction

call_command("migrate", verbosity=0)
errors = [m for m in run_checks(include_deployment_checks=False) if m.level >= ERROR]
assert not errors, errors
from django_idempotency.messaging.relay.loop import Relay
from django_idempotency.models import OutboxMessage
from tests.support.task_targets import EFFECT, record

with transaction.atomic():
    result = record.enqueue(7)
print("enqueued", type(result).__name__)
print("published", Relay().drain())
effects = OutboxMessage.objects.filter(kind=OutboxMessage.Kind.EVENT, name=EFFECT)
print("effects", [row["n"] for row in effects.values_list("payload", flat=True)])
"""


def test_the_outbox_hands_tasks_to_djangos_own_backend_with_nothing_patching_django() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["enqueued TaskResult", "published 1", "effects [7]"]
