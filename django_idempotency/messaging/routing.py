"""What an outbox message's destination is named by: the destination that takes every message
no route names, and the ``BACKEND`` paths of the destinations this package ships. Below the
outbox and the destinations, so that the outbox's Tasks backend can name them without
importing the destinations above it."""

from __future__ import annotations

# The destination that takes every message no route names.
DEFAULT = "default"
CELERY = "django_idempotency.messaging.destinations.celery.CeleryDestination"
NATS = "django_idempotency.messaging.destinations.nats.NatsDestination"
TASKS = "django_idempotency.messaging.destinations.tasks.TasksDestination"
