"""Settings of the chain profile's processes for the ``tasks-rq`` destination: the chain's
(``tests/support/chain_settings.py``), with the charge's ledger posted as a task of Django's
Tasks framework (``PAYMENTS_LEDGER = "tasks"``) through the outbox backend to RQ on the
private redis-server at ``$RQ_URL``, run by ``manage.py rqworker`` processes."""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta

from tests.settings import INSTALLED_APPS
from tests.support.chain_settings import *  # noqa: F403

PAYMENTS_LEDGER = "tasks"
INSTALLED_APPS = [*INSTALLED_APPS, "django_rq"]
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.append("django_tasks")  # the backport (built in from Django 6.0)
RQ_QUEUES = {"default": {"URL": os.environ.get("RQ_URL", "redis://127.0.0.1:1/0")}}
TASKS = {
    "default": {
        "BACKEND": "django_idempotency.messaging.task_backend.OutboxBackend",
        "OPTIONS": {"backend": "rq"},
    },
    "rq": {"BACKEND": "django_tasks_rq.RQBackend"},
}
IDEMPOTENCY_OUTBOX_DESTINATIONS = {
    "default": {"BACKEND": "django_idempotency.messaging.destinations.celery.CeleryDestination"},
    "tasks": {"BACKEND": "django_idempotency.messaging.destinations.tasks.TasksDestination"},
}
# RQ takes a round trip per job (Celery on Redis, one pipeline per batch): a batch must be
# handed over well within the lease (docs/settings.md), or its relay never marks it and
# publishes it again and again. Measured under faults at load 9: 346 rows took 6 to 8 s.
IDEMPOTENCY_OUTBOX_LEASE = timedelta(seconds=10)
IDEMPOTENCY_OUTBOX_BATCH_SIZE = 100
# RQ runs no job twice: a work horse killed mid-task, or a job Redis lost, comes back through
# the relay's redrive, above the slowest ledger task (4 s) plus its wait in the queue.
IDEMPOTENCY_OUTBOX_REDRIVE_AFTER = timedelta(seconds=6)
