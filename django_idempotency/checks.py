"""System checks: ``django_idempotency.E0xx`` for settings, ``W0xx`` for the environment,
``W1xx`` for the records table (``Tags.database``: run by ``migrate`` and by
``check --database``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.db import connections, router

from django_idempotency import beat, partitions
from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord

SCHEDULE_HINT = (
    "Run `manage.py idempotency_partitions` now, and schedule it hourly: the Celery task "
    "django_idempotency.maintain_partitions (IDEMPOTENCY_BEAT_REGISTER = True with "
    "django-celery-beat), cron, or a Kubernetes CronJob."
)


def _ours(app_configs: Sequence[AppConfig] | None) -> bool:
    return app_configs is None or apps.get_app_config("django_idempotency") in app_configs


@register()
def check_beat(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    if not _ours(app_configs) or not conf.BEAT_REGISTER:
        return []
    messages: list[CheckMessage] = []
    if not apps.is_installed("django_celery_beat"):
        messages.append(
            CheckWarning(
                "IDEMPOTENCY_BEAT_REGISTER is True but django_celery_beat is not installed, so "
                "no periodic task runs partition maintenance.",
                hint="Install django-idempotency[celery] and add 'django_celery_beat' to "
                "INSTALLED_APPS, or set IDEMPOTENCY_BEAT_REGISTER = False and schedule "
                "`manage.py idempotency_partitions` hourly with cron or a Kubernetes CronJob.",
                id="django_idempotency.W001",
            )
        )
    try:
        beat.crontab_fields(conf.BEAT_CRONTAB)
    except ValueError as exc:
        messages.append(
            Error(
                f"IDEMPOTENCY_BEAT_CRONTAB: {exc}.",
                hint='Five fields: minute hour day-of-month month day-of-week, e.g. "17 * * * *".',
                id="django_idempotency.E001",
            )
        )
    return messages


@register(Tags.database)
def check_partitions(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    if not _ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql" or not router.allow_migrate_model(
            alias, IdempotencyRecord
        ):
            continue
        kind = partitions.table_kind(connection)
        if kind is None:
            continue  # not migrated yet
        if kind == "plain":
            messages.append(
                CheckWarning(
                    f"{partitions.TABLE} on database {alias!r} is not partitioned: expired "
                    "records are removed by batched DELETEs, which write much more WAL and "
                    "leave the table bloated.",
                    hint="The table was not created by django_idempotency's migration. Migrate "
                    "django_idempotency to zero and back (this deletes the stored records).",
                    id="django_idempotency.W102",
                )
            )
            continue
        found = partitions.list_partitions(connection)
        future = partitions.future_partitions(found, partitions.database_now(connection))
        if len(future) < 2:
            messages.append(
                CheckWarning(
                    f"Only {len(future)} future partitions of {partitions.TABLE} exist on "
                    f"database {alias!r}: partition maintenance is not running. Requests fail "
                    "(503) once no partition holds the day, unless the request path can create "
                    "one.",
                    hint=SCHEDULE_HINT,
                    id="django_idempotency.W101",
                )
            )
        if any(p.default for p in found):
            messages.append(
                CheckWarning(
                    f"{partitions.TABLE} on database {alias!r} has a DEFAULT partition: "
                    "PostgreSQL cannot detach partitions concurrently while it exists, so "
                    "maintenance drops none, and every new partition scans it under an "
                    "exclusive lock.",
                    hint="Move its rows out and drop it; django_idempotency never creates one.",
                    id="django_idempotency.W103",
                )
            )
    return messages
