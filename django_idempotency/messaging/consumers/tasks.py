"""Exactly-once consumption for Django's Tasks framework: the relay hands each outbox message
to the real backend as ``deliver``, a task of this package that carries the message id and the
target task's path, and runs the target through the exactly-once core (``exactly_once``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NoReturn

from django.utils.module_loading import import_string

from django_idempotency.messaging.consumers.exactly_once import Delivery, consume
from django_idempotency.messaging.tasks_framework import InvalidTask, Task, TaskContext
from django_idempotency.messaging.tracing import DJANGO_TASKS, consume_span_from_headers

logger = logging.getLogger("django_idempotency.consumers")


class GivenBack(Exception):
    """This delivery did not run its message and left no record of it (the store was down,
    or another delivery of the message held it): the job fails, and the relay's redrive
    publishes the message again unless the other delivery recorded it."""


if TYPE_CHECKING:
    _TaskBase = Task[..., Any]
else:  # Django's Task is generic in the stubs only: a subscript here raises TypeError
    _TaskBase = Task


# The path a queued job names its task by: the first one (``task_runner.py`` keeps it), so
# that a job queued by one release runs on a worker of another.
QUEUED_AS = "django_idempotency.messaging.task_runner.deliver"


class _Deliver(_TaskBase):
    """A task validated by the real backend at each enqueue, not at import: its backend is
    named by the destination (``Task.using(backend=...)``), not by the settings' default."""

    def __post_init__(self) -> None:
        pass

    @property
    def module_path(self) -> str:
        return QUEUED_AS


def target_of(path: str) -> Task[..., Any]:
    """The task a message names by its module path; InvalidTask if it is none."""
    try:
        found = import_string(path)
    except ImportError as exc:
        raise InvalidTask(f"The outbox message names the task {path!r}: {exc}") from exc
    if not isinstance(found, Task):
        raise InvalidTask(
            f"The outbox message names {path!r}, which is not a task (decorate it with @task)."
        )
    return found


def _give_back(exc: Exception) -> NoReturn:
    raise GivenBack(f"{type(exc).__name__}: {exc}") from exc


def deliver(
    context: TaskContext[..., Any],
    message_id: str,
    target: str,
    args: list[Any],
    kwargs: dict[str, Any],
    trace: dict[str, str] | None = None,
) -> Any:
    """Run ``target(*args, **kwargs)`` once per ``message_id`` (consumer: the target's path),
    in a span that continues the enqueuing request's ``trace`` context when it has one."""
    task = target_of(target)

    def run() -> Any:
        if task.takes_context:
            return task.call(context, *args, **kwargs)
        return task.call(*args, **kwargs)

    with consume_span_from_headers(trace, message_id, target, DJANGO_TASKS):
        return consume(
            Delivery(
                consumer=target,
                message_id=message_id,
                name=target,
                args=tuple(args),
                kwargs=kwargs,
                run=run,
                give_back=_give_back,
                sender=type(task),
                context=context,
            )
        )


# Every field given: Django 6.0's Task has no defaults. The destination sets each message's.
DELIVER: Task[..., Any] = _Deliver(
    func=deliver,
    priority=0,
    backend="default",
    queue_name="default",
    run_after=None,
    takes_context=True,
)
# What the backends import by its path (the function's): a Task, as they require.
deliver = DELIVER  # type: ignore[assignment]
