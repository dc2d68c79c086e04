"""The Django Tasks destination: each message handed to the real backend its message names
(django-tasks-rq, django-tasks-db, ...) as ``consumers.tasks.deliver``, which carries the
message id and runs the target exactly once; sent once the backend's ``enqueue()`` has
returned."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import InterfaceError, OperationalError

from django_idempotency.messaging.consumers.exactly_once import principal
from django_idempotency.messaging.consumers.tasks import DELIVER
from django_idempotency.messaging.destinations import Destination, PublishResult, Stopping
from django_idempotency.messaging.outbox.leases import Message
from django_idempotency.messaging.tasks_framework import task_backends
from django_idempotency.messaging.tracing import DJANGO_TASKS, publish_span
from django_idempotency.models import OutboxMessage

# Out of reach: the backend's store (Redis, a database) down, not a fault of the message.
UNREACHABLE_NAMES = frozenset({"ConnectionError", "TimeoutError", "BusyLoadingError"})


def run_after(message: Message) -> datetime | None:
    """When a message's task may run: its countdown after the enqueue, or None."""
    countdown = message.options.get("countdown")
    return None if countdown is None else message.created_at + timedelta(seconds=countdown)


def _backend_alias(message: Message) -> str:
    alias = message.options.get("backend")
    if not isinstance(alias, str):
        raise ImproperlyConfigured(
            f"Outbox message {message.id} ({message.name}) names no Tasks backend: it was not "
            "written by the outbox backend of TASKS (task_backend.OutboxBackend), and was "
            "routed to a Django Tasks destination by IDEMPOTENCY_OUTBOX_ROUTES."
        )
    return alias


class TasksDestination(Destination):
    """Publishes to backends of Django's Tasks framework (messages written by
    ``outbox.tasks.OutboxBackend``, which names the backend in each). The redrive checks
    the consumer record ``deliver`` makes, and publishes a message again if there is none
    (RQ does not run again a job whose worker died)."""

    redrives = True

    def __init__(self, name: str, options: Mapping[str, Any], *, app: Any = None) -> None:
        self.name = name

    @classmethod
    def validate(cls, name: str, options: Mapping[str, Any]) -> None:
        if options:
            raise ImproperlyConfigured(
                f"The Django Tasks outbox destination {name!r} takes no OPTIONS (the real "
                'backend is named in TASKS, by the outbox backend\'s OPTIONS["backend"]); '
                f"it was given {sorted(options)}."
            )

    def open(self) -> None:
        """The backends connect on their own, at each enqueue."""

    def close(self) -> None:
        """Nothing held between batches."""

    def describe(self) -> str:
        return "Django's Tasks framework, to the backend each message names"

    def consumer_principal(self, kind: int, name: str) -> str | None:
        """The records' principal of ``deliver``'s consumer of such a message."""
        return principal(name) if kind == OutboxMessage.Kind.TASK else None

    def is_connection_error(self, exc: Exception) -> bool:
        return (
            isinstance(exc, (OSError, OperationalError, InterfaceError))
            or type(exc).__name__ in UNREACHABLE_NAMES
        )

    def publish(self, messages: Sequence[Message], stopping: Stopping) -> PublishResult:
        """Enqueue each on its backend, in order, until one fails."""
        done = PublishResult()
        for message in messages:
            if stopping.is_set():
                break
            try:
                backend = task_backends[_backend_alias(message)]
                task = DELIVER.using(
                    backend=backend.alias,
                    queue_name=message.options.get("queue"),
                    priority=message.options.get("priority"),
                    run_after=run_after(message),
                )
                arguments = [message.id, message.name, message.args, message.kwargs]
                options = message.options
                with publish_span(
                    message.id, message.name, options, self.name, DJANGO_TASKS
                ) as traced:
                    # The runner continues the trace from it (its own argument: the backends
                    # carry no headers).
                    backend.enqueue(task, arguments, {"trace": dict(traced)} if traced else {})
            except Exception as exc:
                done.failed, done.error = message, exc
                break
            done.sent.append(message)
        return done
