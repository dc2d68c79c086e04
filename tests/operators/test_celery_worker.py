"""The maintenance task through a real broker and a real worker.

The broker is ``CELERY_BROKER_URL`` (the test project's setting): the in-memory transport
by default, Redis or RabbitMQ when the variable names one. The worker runs in a thread of
this process (``celery.contrib.testing.worker.start_worker``), so results come back
through an in-memory result backend whatever the broker.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

# Celery (the celery extra) is optional: without it these tests skip.
pytest.importorskip("celery")
pytest.importorskip("django_celery_beat")
from celery import Celery
from celery.contrib.testing.worker import start_worker
from django.conf import settings
from django.core.management import call_command
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from django_idempotency import beat, signals
from django_idempotency.beat import TASK_NAME
from django_idempotency.tasks import maintain_partitions
from testproject.celery import app
from tests.support.partitions import (
    detach_and_drop,
    execute,
    partition_name,
    today,
)

pytestmark = [
    pytest.mark.usefixtures("partition_sandbox"),
    pytest.mark.timeout(120),
]


@pytest.fixture(scope="module")
def celery_app() -> Celery:
    """An app configured like the test project's (same CELERY_* settings, same broker),
    that keeps results: the project ignores them, and these tests read them back."""
    test_app = Celery("partitions-tests", set_as_current=False)
    test_app.config_from_object("django.conf:settings", namespace="CELERY")
    test_app.conf.update(
        result_backend="cache+memory://",
        task_ignore_result=False,
        # A queue of this session's own: the broker may be shared (CI's Redis), and a
        # message another run left behind (kombu restores unacked ones) is not ours to run.
        task_default_queue=f"idempotency-tests-{uuid.uuid4().hex}",
        # The worker thread waits on the broker 0.1 s at a time (1 s by default), so that it
        # stops in 0.1 s at the end of the module; it takes a message as soon as it comes.
        broker_transport_options={
            **test_app.conf.broker_transport_options,
            "polling_interval": 0.1,
        },
    )
    test_app.finalize()  # binds the shared tasks, ours among them
    return test_app


@pytest.fixture(scope="module")
def worker(celery_app: Celery, django_db_blocker: Any) -> Iterator[Any]:
    """A worker thread consuming from the broker for this module's tests."""
    with (
        django_db_blocker.unblock(),
        start_worker(
            celery_app, pool="solo", perform_ping_check=False, shutdown_timeout=30
        ) as running,
    ):
        yield running


def run_task(celery_app: Celery, **kwargs: Any) -> dict[str, Any]:
    """Send the task through the broker and wait for the worker's answer."""
    result = celery_app.tasks[TASK_NAME].apply_async(kwargs=kwargs)
    report: dict[str, Any] = result.get(timeout=60)
    return report


@pytest.fixture
def created() -> Iterator[list[tuple[list[str], str]]]:
    """``partitions_created`` as sent, with the name of the thread that sent it."""
    sent: list[tuple[list[str], str]] = []

    def receiver(sender: Any, names: list[str], **kwargs: Any) -> None:
        sent.append((names, threading.current_thread().name))

    signals.partitions_created.connect(receiver)
    yield sent
    signals.partitions_created.disconnect(receiver)


def test_the_broker_is_the_projects_and_the_task_is_found(celery_app: Celery, worker: Any) -> None:
    assert celery_app.conf.broker_url == app.conf.broker_url == settings.CELERY_BROKER_URL
    # The project app finds the task by autodiscovery, as any project's would.
    assert app.tasks[TASK_NAME].name == maintain_partitions.name == TASK_NAME


def test_the_worker_runs_maintenance_sent_through_the_broker(
    celery_app: Celery, worker: Any, created: list[tuple[list[str], str]]
) -> None:
    missing = today() + timedelta(days=3)
    detach_and_drop(missing)
    report = run_task(celery_app)
    assert report["created"] == [partition_name(missing)]
    assert execute("SELECT to_regclass(%s) IS NOT NULL", [partition_name(missing)]) == [(True,)]
    ((names, thread),) = created
    assert names == [partition_name(missing)]
    assert thread != threading.current_thread().name  # the worker's, not ours


def test_beat_sends_the_registered_task_and_the_worker_runs_it(
    celery_app: Celery, worker: Any, created: list[tuple[list[str], str]]
) -> None:
    call_command("idempotency_install_schedule")
    # An operator's edit: every second instead of hourly, so the test need not wait.
    row = PeriodicTask.objects.get(name=beat.SCHEDULE_NAME)
    row.crontab = None
    row.interval = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    row.save()
    missing = today() + timedelta(days=2)
    detach_and_drop(missing)
    scheduler = DatabaseScheduler(app=celery_app)
    deadline = time.monotonic() + 60
    while not created and time.monotonic() < deadline:
        scheduler.tick()
        time.sleep(0.2)
    assert created and created[0][0] == [partition_name(missing)]
    row.refresh_from_db()
    assert row.total_run_count >= 1 and row.last_run_at is not None
