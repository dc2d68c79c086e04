"""Every import path of the messaging wing that the docs, the test project or the changelog
give users keeps working, wherever its code lives: settings and task modules name these, and
queued Django Tasks jobs carry ``task_runner.deliver``'s path."""

from __future__ import annotations

import pytest
from django.utils.module_loading import import_string

from django_idempotency.messaging.consumers.tasks import DELIVER

WING = "django_idempotency.messaging"
PATHS = [
    "django_idempotency.messaging.NotInTransaction",
    "django_idempotency.messaging.OutboxError",
    "django_idempotency.messaging.OutsideUnitOfWork",
    "django_idempotency.messaging.derive_key",
    "django_idempotency.messaging.emit_event",
    "django_idempotency.messaging.enqueue_event",
    "django_idempotency.messaging.enqueue_task",
    "django_idempotency.messaging.outbox.enqueue_task",
    "django_idempotency.messaging.outbox.enqueue_event",
    "django_idempotency.messaging.outbox.NotInTransaction",
    "django_idempotency.messaging.outbox.OutboxError",
    "django_idempotency.messaging.outbox.OUTBOX",
    "django_idempotency.messaging.outbox_task.OutboxTask",
    "django_idempotency.messaging.task_backend.OutboxBackend",
    "django_idempotency.messaging.task_runner.deliver",
    "django_idempotency.messaging.tasks_framework.task",
    "django_idempotency.messaging.tasks_framework.TaskContext",
    "django_idempotency.messaging.destinations.Destination",
    "django_idempotency.messaging.destinations.Publication",
    "django_idempotency.messaging.destinations.celery.CeleryDestination",
    "django_idempotency.messaging.destinations.nats.NatsDestination",
    "django_idempotency.messaging.destinations.tasks.TasksDestination",
    "django_idempotency.messaging.consumers.ExactlyOnceTask",
    "django_idempotency.messaging.downstream.derive_key",
    "django_idempotency.messaging.downstream.OutsideUnitOfWork",
    "django_idempotency.messaging.cdc.emit_event",
    "django_idempotency.messaging.cdc.EVENTS",
    "django_idempotency.messaging.nats_consumer.NatsConsumer",
    "django_idempotency.messaging.nats_consumer.StreamMessage",
    "django_idempotency.messaging.exactly_once.consume",
    "django_idempotency.messaging.exactly_once.Delivery",
]


@pytest.mark.parametrize("path", PATHS)
def test_a_documented_path_imports(path: str) -> None:
    assert import_string(path) is not None


def test_a_queued_job_names_deliver_by_its_first_path_and_that_path_is_the_task() -> None:
    path = "django_idempotency.messaging.task_runner.deliver"

    assert DELIVER.module_path == path
    assert DELIVER.using(backend="default").module_path == path
    assert import_string(path) is DELIVER


def test_the_first_paths_are_the_moved_objects_not_copies() -> None:
    moved = {
        "outbox_task.OutboxTask": "outbox.celery.OutboxTask",
        "task_backend.OutboxBackend": "outbox.tasks.OutboxBackend",
        "consumers.ExactlyOnceTask": "consumers.celery.ExactlyOnceTask",
        "nats_consumer.NatsConsumer": "consumers.nats.NatsConsumer",
        "exactly_once.consume": "consumers.exactly_once.consume",
    }
    for old, new in moved.items():
        assert import_string(f"{WING}.{old}") is import_string(f"{WING}.{new}"), old
