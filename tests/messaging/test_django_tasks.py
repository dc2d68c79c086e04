"""Django's Tasks framework through the outbox: ``OutboxBackend`` writes the task in the
transaction, the relay hands it to a real backend (RQ on a private redis-server, and
django-tasks-db), and ``task_runner.deliver`` runs it exactly once, with real workers killed
(SIGKILL) mid-task and after commit (docs/outbox.md, Django's Tasks framework)."""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip(
    "django_tasks_rq",
    reason="django-tasks-rq is not installed: it cannot share a virtualenv with "
    "django-celery-beat; .ci/run runs this module with tox -e py312-django60-tasks",
)
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone
from django_tasks.exceptions import InvalidTaskError

from django_idempotency.checks.messaging import check_task_backends
from django_idempotency.messaging import NotInTransaction
from django_idempotency.messaging import destinations as destinations_module
from django_idempotency.messaging.consumers.exactly_once import principal
from django_idempotency.messaging.relay.loop import PublishFailed, Relay
from django_idempotency.messaging.tasks_framework import InvalidTask, task_backends
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from tests.conftest import ROOT, die_with_parent, unmeasured
from tests.messaging.test_relay import log_of, relay_process, wait_started
from tests.support import tasks_settings
from tests.support.chain_processes import RedisServer, kill_group, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

with contextlib.suppress(ImportError):  # the backport resets its backends on setting_changed
    import django_tasks.signals  # noqa: F401

TARGET = "tests.support.task_targets.record"
EFFECT = "tests.tasks.effect"


@pytest.fixture
def rq_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer.on_free_port(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def tasks(settings: Any) -> ModuleType:
    """The Tasks settings of the chain's processes, here too; the test tasks' module."""
    settings.TASKS = tasks_settings.TASKS
    settings.IDEMPOTENCY_OUTBOX_DESTINATIONS = tasks_settings.IDEMPOTENCY_OUTBOX_DESTINATIONS
    settings.RQ_QUEUES = tasks_settings.RQ_QUEUES
    return importlib.import_module("tests.support.task_targets")


@pytest.fixture
def env(subprocess_env: dict[str, str], rq_redis: RedisServer) -> dict[str, str]:
    """The chain's processes: the test database, the private redis (RQ's, and the Celery
    broker of the default destination, where the effects' events go)."""
    return {
        **subprocess_env,
        "DJANGO_SETTINGS_MODULE": "tests.support.tasks_settings",
        "RQ_URL": rq_redis.url,
        "CELERY_BROKER_URL": rq_redis.url,
    }


class Worker:
    """A worker of a real backend (``manage.py rqworker``, ``db_worker``), logging into a
    file, in a process group of its own (RQ forks a work horse per job)."""

    def __init__(self, env: dict[str, str], *command: str) -> None:
        self.log = Path(tempfile.mkstemp(prefix="tasks-worker-", suffix=".log")[1])
        with self.log.open("a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", *command], cwd=ROOT, env=unmeasured(env),
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        kill_group(self.process)

    def stop(self) -> None:
        self.kill()
        self.log.unlink(missing_ok=True)


@contextlib.contextmanager
def rq_worker(env: dict[str, str]) -> Iterator[Worker]:
    worker = Worker(env, "rqworker", "--job-class", "django_tasks_rq.Job", "default")
    try:
        yield worker
    finally:
        worker.stop()


def effects() -> Counter[int]:
    """How often each task's effect was committed."""
    payloads = OutboxMessage.objects.filter(kind=OutboxMessage.Kind.EVENT, name=EFFECT).values_list(
        "payload", flat=True
    )
    return Counter(payload["n"] for payload in payloads)


def recorded(ids: list[str], target: str = TARGET) -> int:
    return IdempotencyRecord.objects.filter(scope=principal(target), key__in=ids).count()


def settled(ids: list[str]) -> bool:
    """Every message published and its redrive check done (its consumer record found)."""
    return not OutboxMessage.objects.filter(pk__in=ids, redrive_at__isnull=False).exists() and (
        OutboxMessage.objects.filter(pk__in=ids, published_at__isnull=False).count() == len(ids)
    )


# The backend ----------------------------------------------------------------------------


def test_enqueue_writes_the_task_into_the_outbox_and_its_result_id_is_the_message_id(
    tasks: ModuleType,
) -> None:
    with transaction.atomic():
        result = tasks.record.using(queue_name="default").enqueue(7, die=None)
    row = OutboxMessage.objects.get()
    assert result.id == str(row.pk) and result.backend == "default"
    assert result.status == "READY" and result.args == [7] and result.kwargs == {"die": None}
    assert row.kind == OutboxMessage.Kind.TASK and row.name == TARGET
    assert (row.args, row.kwargs) == ([7], {"die": None})
    assert row.options == {
        "destination": "tasks",
        "backend": "rq",
        "queue": "default",
        "priority": 0,
    }


def test_a_rolled_back_transaction_enqueues_nothing(tasks: ModuleType) -> None:
    with contextlib.suppress(ZeroDivisionError), transaction.atomic():
        tasks.record.enqueue(1)
        1 / 0  # noqa: B018
    assert not OutboxMessage.objects.exists()


def test_enqueue_outside_a_transaction_is_refused_naming_the_fix(tasks: ModuleType) -> None:
    with pytest.raises(NotInTransaction, match=r"record\.enqueue\(\) goes through the outbox"):
        tasks.record.enqueue(1)
    assert not OutboxMessage.objects.exists()


def test_what_the_real_backend_refuses_is_refused_at_enqueue(tasks: ModuleType) -> None:
    with transaction.atomic():
        # The real backend's own error: on Django 6.0, django-tasks-rq still raises the
        # backport's.
        with pytest.raises((InvalidTask, InvalidTaskError), match="Queue 'nowhere'"):
            tasks.record.using(queue_name="nowhere").enqueue(1)
        with pytest.raises(Exception, match="JSON"):
            tasks.record.enqueue(object())
    assert not OutboxMessage.objects.exists()


def test_the_real_backends_features_are_the_outbox_backends(tasks: ModuleType) -> None:
    outbox, rq = task_backends["default"], task_backends["rq"]
    assert outbox.supports_defer == rq.supports_defer is True
    assert outbox.supports_priority == rq.supports_priority
    assert outbox.supports_get_result is False


@pytest.mark.parametrize(
    ("options", "destinations", "expected"),
    [
        ({}, None, 'has no "backend"'),
        ({"backend": "default"}, None, "names this backend itself"),
        ({"backend": "nope"}, None, "'nope', which TASKS does not define"),
        ({"backend": "other"}, None, "another outbox backend"),
        ({"backend": "rq", "queue": 1}, None, "unknown keys ['queue']"),
        ({"backend": "rq", "destination": "elsewhere"}, None, "no 'elsewhere' destination"),
        ({"backend": "rq"}, {"default": tasks_settings.IDEMPOTENCY_OUTBOX_DESTINATIONS["default"],
                             "tasks": tasks_settings.IDEMPOTENCY_OUTBOX_DESTINATIONS["default"]},
         "must be 'django_idempotency.messaging.destinations.tasks.TasksDestination'"),
    ],
)  # fmt: skip
def test_a_misconfigured_outbox_backend_fails_its_check_naming_the_fix(
    tasks: ModuleType,
    settings: Any,
    options: dict[str, Any],
    destinations: dict[str, Any] | None,
    expected: str,
) -> None:
    backend = tasks_settings.OUTBOX_BACKEND
    settings.TASKS = {
        **tasks_settings.TASKS,
        "default": {"BACKEND": backend, "OPTIONS": options},
        "other": {"BACKEND": backend, "OPTIONS": {"backend": "rq"}},
    }
    if destinations is not None:
        settings.IDEMPOTENCY_OUTBOX_DESTINATIONS = destinations
    # The other outbox backends share the destination setting: only this one's errors here.
    errors = [e for e in check_task_backends(None) if e.obj == "TASKS['default']"]
    assert [e.id for e in errors] == ["django_idempotency.E122"]
    assert expected in errors[0].msg
    with transaction.atomic(), pytest.raises(ImproperlyConfigured, match=re.escape(expected)):
        task_backends["default"].enqueue(tasks.record, [1], {})


def test_the_check_passes_a_good_configuration_and_ignores_other_backends(
    tasks: ModuleType,
) -> None:
    assert check_task_backends(None) == []


def test_the_destination_takes_no_options(tasks: ModuleType, settings: Any) -> None:
    settings.IDEMPOTENCY_OUTBOX_DESTINATIONS = {
        **tasks_settings.IDEMPOTENCY_OUTBOX_DESTINATIONS,
        "tasks": {"BACKEND": destinations_module.TASKS, "OPTIONS": {"backend": "rq"}},
    }
    with pytest.raises(ImproperlyConfigured, match="takes no OPTIONS"):
        destinations_module.configured()


# Through RQ, with real workers ------------------------------------------------------------


def test_the_relay_hands_tasks_to_rq_and_a_real_worker_runs_each_once(
    tasks: ModuleType, settings: Any, rq_redis: RedisServer, env: dict[str, str]
) -> None:
    settings.RQ_QUEUES = {"default": {"URL": rq_redis.url}}
    with transaction.atomic():
        ids = [tasks.record.enqueue(n).id for n in range(5)]
        ids.append(tasks.record_with_context.enqueue(5).id)
    assert Relay().drain() == 6
    # RQ has the jobs: each the package's deliver task, carrying the message id and target.
    queued = rq_redis.client().lrange("rq:queue:default", 0, -1)
    assert len(queued) == 6
    with rq_worker(env) as worker:
        wait_for(lambda: sum(effects().values()) == 6, timeout=60)
        assert recorded(ids[:5]) == 5, worker.text()
        assert recorded(ids[5:], "tests.support.task_targets.record_with_context") == 1
        # The relay publishes one again (a lost mark, a manual replay): no second effect.
        # (The effects' events are not this test's to publish: to Celery, they stay put.)
        OutboxMessage.objects.filter(name=EFFECT).update(published_at=timezone.now())
        OutboxMessage.objects.filter(pk=ids[0]).update(published_at=None)
        assert Relay().drain() == 1
        wait_for(lambda: "already ran; acknowledged" in worker.text(), timeout=60)
    assert effects() == Counter(range(6))


def test_a_redis_that_is_down_holds_nothing_back_and_the_rows_go_out_once_it_is_back(
    tasks: ModuleType, settings: Any, rq_redis: RedisServer
) -> None:
    settings.RQ_QUEUES = {"default": {"URL": rq_redis.url}}
    with transaction.atomic():
        ids = [tasks.record.enqueue(n).id for n in range(3)]
    rq_redis.stop()
    with pytest.raises(PublishFailed, match="ConnectionError"):
        Relay().drain()
    # Out of reach is no fault of the message: pending, not held back, never a dead letter.
    rows = OutboxMessage.objects.filter(pk__in=ids)
    assert [(r.published_at, r.dead_at, r.lease_until) for r in rows] == [(None, None, None)] * 3
    rq_redis.start()
    assert Relay().drain() == 3
    assert len(rq_redis.client().lrange("rq:queue:default", 0, -1)) == 3


def test_workers_killed_mid_task_and_after_commit_leave_each_task_one_effect(
    tasks: ModuleType,
    rq_redis: RedisServer,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    """The work horse dies (SIGKILL) once before its transaction commits (no record: RQ
    counts the job failed, and the relay's redrive publishes it again) or once after (the
    record is there: the redrive finds it and publishes nothing), and the whole worker is
    killed while tasks are queued; each of the 12 tasks has exactly one effect."""
    marks = tmp_path / "marks"
    marks.mkdir()
    dying = {n: ("before", "after", None)[n % 3] for n in range(12)}
    with transaction.atomic():
        ids = [tasks.record.enqueue(n, die=dying[n], marks=str(marks)).id for n in range(12)]
    with relay_process(env) as relay:
        wait_started(relay)
        worker = Worker(env, "rqworker", "--job-class", "django_tasks_rq.Job", "default")
        try:
            wait_for(lambda: sum(1 for _ in marks.iterdir()) >= 2, timeout=60)
            worker.kill()  # the whole worker too, with whatever it holds
            worker.stop()
            worker = Worker(env, "rqworker", "--job-class", "django_tasks_rq.Job", "default")
            wait_for(lambda: recorded(ids) == 12 and settled(ids), timeout=120)
        finally:
            text = worker.text()
            worker.stop()
        assert "published again" in log_of(relay), log_of(relay)
    assert effects() == Counter(range(12)), text
    assert sorted(p.name for p in marks.iterdir()) == sorted(
        f"{when}-{n}" for n, when in dying.items() if when
    )


# Through django-tasks-db, with its real worker ---------------------------------------------


def test_the_relay_hands_tasks_to_the_database_backend_and_its_worker_runs_each_once(
    tasks: ModuleType, env: dict[str, str]
) -> None:
    pytest.importorskip("django_tasks_db")

    def manage(*command: str) -> None:
        # The backend's models are installed in the chain's settings, not the test process's.
        done = subprocess.run(
            [sys.executable, "manage.py", *command], cwd=ROOT, env=unmeasured(env),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    manage("migrate", "django_tasks_database", "--no-input")  # its table, in the test database
    with transaction.atomic():
        ids = [tasks.record_db.enqueue(n).id for n in range(3)]
    manage("idempotency_relay", "--once")
    # Published twice (a relay that lost its mark): the worker replays, no second effect.
    OutboxMessage.objects.filter(pk=ids[0]).update(published_at=None)
    manage("idempotency_relay", "--once")
    assert OutboxMessage.objects.filter(pk__in=ids, published_at__isnull=True).count() == 0
    worker = Worker(env, "db_worker", "--backend", "db", "--interval", "0.2", "--no-startup-delay")
    try:
        wait_for(lambda: recorded(ids, "tests.support.task_targets.record_db") == 3, timeout=60)
        wait_for(lambda: "already ran; acknowledged" in worker.text(), timeout=60)
    finally:
        text = worker.text()
        worker.stop()
    assert effects() == Counter(range(3)), text
