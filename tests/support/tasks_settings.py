"""Settings of the Django Tasks chain's processes (``tests/messaging/test_django_tasks.py``): the
test settings, with tasks enqueued through the outbox (``TASKS["default"]``) and handed by the
relay to RQ (``TASKS["rq"]``) on the private redis-server at ``RQ_URL``, or to the database
(``TASKS["db"]``, django-tasks-db, when installed); a redrive after 2 s."""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

OUTBOX_BACKEND = "django_idempotency.messaging.task_backend.OutboxBackend"

INSTALLED_APPS = [*INSTALLED_APPS, "django_rq"]
RQ_QUEUES = {"default": {"URL": os.environ.get("RQ_URL", "redis://127.0.0.1:1/0")}}
TASKS = {
    "default": {"BACKEND": OUTBOX_BACKEND, "OPTIONS": {"backend": "rq"}},
    "rq": {"BACKEND": "django_tasks_rq.RQBackend"},
}
if importlib.util.find_spec("django_tasks_db") is not None:
    INSTALLED_APPS.append("django_tasks_db")
    TASKS["outbox_db"] = {"BACKEND": OUTBOX_BACKEND, "OPTIONS": {"backend": "db"}}
    TASKS["db"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.append("django_tasks")  # the backport's checks (built in from Django 6.0)

IDEMPOTENCY_OUTBOX_DESTINATIONS = {
    "default": {"BACKEND": "django_idempotency.messaging.destinations.celery.CeleryDestination"},
    "tasks": {"BACKEND": "django_idempotency.messaging.destinations.tasks.TasksDestination"},
}
IDEMPOTENCY_OUTBOX_LEASE = timedelta(seconds=2)
IDEMPOTENCY_OUTBOX_POLL_INTERVAL = timedelta(milliseconds=500)
# RQ does not run again a job whose worker died: the relay publishes it again within seconds.
IDEMPOTENCY_OUTBOX_REDRIVE_AFTER = timedelta(seconds=2)
