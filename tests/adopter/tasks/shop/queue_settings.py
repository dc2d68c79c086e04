"""Django's Tasks framework through the outbox, run by django-tasks-db's worker; no Celery."""

from .team_settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]

TASKS = {
    "default": {
        "BACKEND": "django_idempotency.messaging.task_backend.OutboxBackend",
        "OPTIONS": {"backend": "db"},  # the alias below, whose worker runs the tasks
    },
    "db": {"BACKEND": "django_tasks_db.DatabaseBackend"},
}
# No Celery: the Tasks destination is the outbox's only one, so its default.
IDEMPOTENCY_OUTBOX_DESTINATIONS = {
    "default": {"BACKEND": "django_idempotency.messaging.destinations.tasks.TasksDestination"},
}
