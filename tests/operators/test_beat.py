"""The periodic task in django-celery-beat's schedule: created once after migrate, never
overwritten, picked up by the DatabaseScheduler, (re)installed by a command."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import modify_settings, override_settings

# django-celery-beat (the beat extra) is optional: without it these tests skip.
pytest.importorskip("django_celery_beat")
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from django_idempotency import beat
from testproject.celery import app

pytestmark = pytest.mark.django_db(transaction=True)


def our_rows() -> list[PeriodicTask]:
    return list(PeriodicTask.objects.filter(task=beat.TASK_NAME))


def scheduler_entry() -> Any:
    """Start a DatabaseScheduler, as ``celery beat`` does, and return our entry."""
    return DatabaseScheduler(app=app).schedule[beat.SCHEDULE_NAME]


@override_settings(IDEMPOTENCY_BEAT_REGISTER=True)
def test_migrate_creates_the_periodic_task_once() -> None:
    call_command("migrate", verbosity=0)
    (row,) = our_rows()
    assert row.name == beat.SCHEDULE_NAME and row.enabled
    assert str(row.crontab) == str(CrontabSchedule(minute="17", timezone="UTC"))
    assert "Edit freely" in row.description
    schedules = CrontabSchedule.objects.count()
    call_command("migrate", verbosity=0)
    assert [r.pk for r in our_rows()] == [row.pk]
    assert CrontabSchedule.objects.count() == schedules


def test_migrate_creates_nothing_unless_asked() -> None:
    call_command("migrate", verbosity=0)
    assert our_rows() == []


@override_settings(IDEMPOTENCY_BEAT_REGISTER=True, IDEMPOTENCY_BEAT_CRONTAB="5 */2 * * 1-5")
def test_the_crontab_comes_from_the_setting() -> None:
    call_command("migrate", verbosity=0)
    (row,) = our_rows()
    crontab = row.crontab
    assert (
        crontab.minute,
        crontab.hour,
        crontab.day_of_month,
        crontab.month_of_year,
        crontab.day_of_week,
    ) == ("5", "*/2", "*", "*", "1-5")
    assert str(crontab.timezone) == "UTC"


@override_settings(IDEMPOTENCY_BEAT_REGISTER=True)
def test_an_edited_schedule_survives_migrate_and_a_scheduler_restart() -> None:
    call_command("migrate", verbosity=0)
    assert scheduler_entry().task == beat.TASK_NAME
    # What an operator does in the admin: another schedule, arguments, a queue.
    (row,) = our_rows()
    # Every hour: DatabaseScheduler leaves out crontab rows whose hours are far from
    # the current one, so a fixed hour would make this test depend on the time of day.
    row.crontab = CrontabSchedule.objects.create(minute="*/5", hour="*", timezone="UTC")
    row.kwargs = json.dumps({"drop": False})
    row.queue = "maintenance"
    row.save()

    call_command("migrate", verbosity=0)
    first = scheduler_entry()
    restarted = scheduler_entry()

    (row,) = our_rows()
    assert (row.crontab.minute, row.crontab.hour) == ("*/5", "*")
    assert row.kwargs == '{"drop": false}' and row.queue == "maintenance"
    for entry in (first, restarted):
        assert entry.task == beat.TASK_NAME
        assert entry.kwargs == {"drop": False}
        assert entry.options["queue"] == "maintenance"
        assert entry.schedule.minute == set(range(0, 60, 5))
        assert entry.schedule.hour == set(range(24))


@override_settings(IDEMPOTENCY_BEAT_REGISTER=True)
def test_a_disabled_or_deleted_row_stays_as_the_operator_left_it() -> None:
    call_command("migrate", verbosity=0)
    (row,) = our_rows()
    row.enabled = False
    row.save()
    call_command("migrate", verbosity=0)
    assert not our_rows()[0].enabled
    assert beat.SCHEDULE_NAME not in DatabaseScheduler(app=app).schedule
    # Renamed: the fixed name is how the row is found, so a new one is made.
    row.name = "partitions, my way"
    row.save()
    call_command("migrate", verbosity=0)
    assert sorted(r.name for r in our_rows()) == [beat.SCHEDULE_NAME, "partitions, my way"]


def test_install_schedule_creates_keeps_and_with_force_resets() -> None:
    out = StringIO()
    call_command("idempotency_install_schedule", stdout=out)
    assert "created: 17 * * * *" in out.getvalue()
    (row,) = our_rows()
    row.crontab = None
    row.interval = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.MINUTES)
    row.enabled = False
    row.save()

    out = StringIO()
    call_command("idempotency_install_schedule", stdout=out)
    assert "left as it is" in out.getvalue()
    assert our_rows()[0].interval is not None

    out = StringIO()
    call_command("idempotency_install_schedule", "--force", stdout=out)
    assert "reset: 17 * * * *" in out.getvalue()
    (row,) = our_rows()
    assert row.interval is None and row.enabled and row.crontab.minute == "17"
    assert scheduler_entry().schedule.minute == {17}


@override_settings(IDEMPOTENCY_BEAT_REGISTER=True)
def test_the_schedule_tracker_is_touched_so_a_running_beat_reloads() -> None:
    from django_celery_beat.models import PeriodicTasks

    before = PeriodicTasks.last_change()
    call_command("migrate", verbosity=0)
    after = PeriodicTasks.last_change()
    assert after is not None and (before is None or after > before)


@modify_settings(INSTALLED_APPS={"remove": "django_celery_beat"})
@override_settings(IDEMPOTENCY_BEAT_REGISTER=True)
def test_without_django_celery_beat_migrate_is_quiet_and_the_command_says_why() -> None:
    call_command("migrate", verbosity=0)
    with pytest.raises(CommandError, match="django_celery_beat is not in INSTALLED_APPS"):
        call_command("idempotency_install_schedule")


def test_crontab_fields() -> None:
    assert beat.crontab_fields("17 * * * *") == {
        "minute": "17",
        "hour": "*",
        "day_of_month": "*",
        "month_of_year": "*",
        "day_of_week": "*",
    }
    with pytest.raises(ValueError, match="expected 5 fields, got 1"):
        beat.crontab_fields("hourly")
