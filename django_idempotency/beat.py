"""The maintenance task's row in django-celery-beat's database schedule.

Created once, after ``migrate``, when ``IDEMPOTENCY_BEAT_REGISTER`` is on; never updated
afterwards, so schedule edits made in the admin survive ``migrate`` and beat restarts
(``CELERY_BEAT_SCHEDULE`` would be re-applied at every beat start and erase them).
``manage.py idempotency_install_schedule [--force]`` (re)installs it explicitly.
Imports neither Celery nor django-celery-beat, so both stay optional.
"""

from __future__ import annotations

import logging
from typing import Any

from django.apps import AppConfig
from django.apps import apps as global_apps
from django.apps.registry import Apps
from django.db import router
from django.db.models.signals import post_migrate
from django.utils import timezone

from django_idempotency.conf import conf

logger = logging.getLogger("django_idempotency.partitions")

TASK_NAME = "django_idempotency.maintain_partitions"
# The row's fixed name: how we find it again, whatever else an operator changed.
SCHEDULE_NAME = "django-idempotency: maintain partitions"
DESCRIPTION = (
    "Created by django-idempotency: creates upcoming partitions of its tables (records, and "
    "the messaging tables) and drops expired ones. Edit freely: migrate and beat restarts "
    "keep your changes; `manage.py idempotency_install_schedule --force` resets this row."
)
CRONTAB_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")


class BeatNotInstalled(LookupError):
    pass


def crontab_fields(spec: str) -> dict[str, str]:
    """``"17 * * * *"`` (minute hour day-of-month month day-of-week) as CrontabSchedule fields,
    each read by Celery's own parser where Celery is installed: beat would otherwise fail on
    the row at its next start, not here."""
    parts = spec.split()
    if len(parts) != len(CRONTAB_FIELDS):
        raise ValueError(f"{spec!r} is not a crontab: expected 5 fields, got {len(parts)}")
    fields = dict(zip(CRONTAB_FIELDS, parts, strict=True))
    try:
        from celery.schedules import crontab
    except ImportError:
        return fields  # no beat to run it: django_idempotency.W001 says so
    for name, value in fields.items():
        try:
            crontab(**{name: value})
        except ValueError as exc:
            field = name.replace("_", "-")
            reason = str(exc).rstrip(".")
            message = f"{spec!r}: Celery cannot read the {field} {value!r} ({reason})"
            raise ValueError(message) from None
    return fields


def install_schedule(
    *, using: str | None = None, apps: Apps = global_apps, force: bool = False
) -> tuple[Any, str]:
    """Get or create the periodic task by its fixed name; ``force`` resets it to our defaults.

    Returns the row and what happened to it: ``"created"``, ``"kept"`` or ``"reset"``.
    ``apps`` may be a migration state's registry (from ``post_migrate``).
    """
    try:
        periodic_task = apps.get_model("django_celery_beat", "PeriodicTask")
        crontab_schedule = apps.get_model("django_celery_beat", "CrontabSchedule")
        periodic_tasks = apps.get_model("django_celery_beat", "PeriodicTasks")
    except LookupError as exc:
        raise BeatNotInstalled(
            "django_celery_beat is not in INSTALLED_APPS; schedule "
            "`manage.py idempotency_partitions` hourly with cron or a Kubernetes CronJob "
            "instead"
        ) from exc
    using = using or router.db_for_write(periodic_task)
    row = periodic_task._default_manager.using(using).filter(name=SCHEDULE_NAME).first()
    if row is not None and not force:
        return row, "kept"
    fields = {**crontab_fields(conf.BEAT_CRONTAB), "timezone": "UTC"}
    # CrontabSchedule has no unique constraint: get_or_create() could find two.
    schedules = crontab_schedule._default_manager.using(using)
    crontab = schedules.filter(**fields).first() or schedules.create(**fields)
    defaults = {
        "task": TASK_NAME,
        "crontab": crontab,
        "interval": None,
        "solar": None,
        "clocked": None,
        "args": "[]",
        "kwargs": "{}",
        "enabled": True,
        "one_off": False,
        "start_time": None,
        "expires": None,
        "description": DESCRIPTION,
    }
    if row is None:
        row = periodic_task._default_manager.using(using).create(name=SCHEDULE_NAME, **defaults)
        outcome = "created"
    else:
        for name, value in defaults.items():
            setattr(row, name, value)
        row.save(using=using)
        outcome = "reset"
    # PeriodicTasks.update_changed(), on ``using``: historical models (post_migrate) have
    # neither its classmethods nor the save() hook that calls it, and beat only re-reads
    # the schedule once this row changes.
    periodic_tasks._default_manager.using(using).update_or_create(
        ident=1, defaults={"last_update": timezone.now()}
    )
    logger.info("Periodic task %r %s on %s", SCHEDULE_NAME, outcome, using)
    return row, outcome


def install_after_migrate(
    sender: AppConfig, *, using: str, apps: Apps = global_apps, **kwargs: Any
) -> None:
    """``post_migrate`` receiver: create the periodic task if asked to and it is missing."""
    if not conf.BEAT_REGISTER:
        return
    try:
        periodic_task = apps.get_model("django_celery_beat", "PeriodicTask")
    except LookupError:
        return  # the check django_idempotency.W001 says why
    if router.allow_migrate_model(using, periodic_task):
        install_schedule(using=using, apps=apps)


def connect_signals() -> None:
    """Connect ``install_after_migrate``; called from ``AppConfig.ready()``."""
    post_migrate.connect(
        install_after_migrate,
        sender=global_apps.get_app_config("django_idempotency"),
        dispatch_uid="django_idempotency.beat.install_after_migrate",
    )
