"""``OutboxBackend``: a backend of Django's Tasks framework whose ``enqueue()`` writes the task
into the outbox, in the current transaction; the relay hands it to a real backend
(``destinations.tasks``), where ``consumers.tasks`` runs it exactly once (docs/outbox.md)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ParamSpec, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import import_string

from django_idempotency.conf import conf
from django_idempotency.messaging.outbox import NotInTransaction, in_transaction, write_message
from django_idempotency.messaging.routing import DEFAULT
from django_idempotency.messaging.routing import TASKS as TASKS_DESTINATION
from django_idempotency.messaging.tasks_framework import (
    BaseTaskBackend,
    Task,
    TaskResult,
    TaskResultStatus,
    task_backends,
)
from django_idempotency.models import OutboxMessage

P = ParamSpec("P")
R = TypeVar("R")

# The outbox destination its messages go to, unless OPTIONS["destination"] names another, or
# the project has no such destination and its default one is the Tasks destination (no Celery).
DEFAULT_DESTINATION = "tasks"
OPTIONS = frozenset({"backend", "destination", "using"})


class OutboxBackend(BaseTaskBackend):
    """Enqueues into the outbox: published to ``OPTIONS["backend"]`` (another alias of
    ``TASKS``, a real backend such as django-tasks-rq's) if and only if the transaction that
    enqueued it commits, through the outbox destination ``OPTIONS["destination"]`` (default
    ``"tasks"``). The result's id is the outbox message id. Features (deferral, priority,
    queues) are the real backend's; results are not kept here (``supports_get_result``)."""

    supports_get_result = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.real_alias: str | None = self.options.get("backend")
        self.named_destination: str | None = self.options.get("destination")
        self.using: str | None = self.options.get("using")

    @property
    def destination(self) -> str:
        """The outbox destination of its messages. Unnamed: ``"tasks"``; in a project without
        Celery, whose only ``"default"`` destination is the Tasks one, that one (read at call
        time, as every setting is)."""
        if self.named_destination is not None:
            return self.named_destination
        declared = conf.OUTBOX_DESTINATIONS
        default = declared.get(DEFAULT)
        backend = default.get("BACKEND") if isinstance(default, dict) else None
        if (
            DEFAULT_DESTINATION not in declared
            and isinstance(backend, str)
            and _is_tasks_destination(backend)
        ):
            return DEFAULT
        return DEFAULT_DESTINATION

    # The real backend's features are this backend's (none while it is misconfigured).
    @property
    def supports_defer(self) -> bool:  # type: ignore[override]
        return self._feature("supports_defer")

    @property
    def supports_priority(self) -> bool:  # type: ignore[override]
        return self._feature("supports_priority")

    @property
    def supports_async_task(self) -> bool:  # type: ignore[override]
        return self._feature("supports_async_task")

    @property
    def real(self) -> BaseTaskBackend:
        """The backend the relay hands the tasks to; ImproperlyConfigured naming the fix."""
        problem = next(self.problems(), None)
        if problem is not None:
            raise ImproperlyConfigured(problem)
        return task_backends[str(self.real_alias)]

    def _feature(self, name: str) -> bool:
        try:
            return bool(getattr(self.real, name))
        except ImproperlyConfigured:
            return False

    def problems(self) -> Iterator[str]:
        """What is wrong with this backend's OPTIONS, each naming the fix (the check
        ``django_idempotency.E122``, in ``checks/messaging.py``)."""
        where = f'TASKS[{self.alias!r}]["OPTIONS"]'
        unknown = set(self.options) - OPTIONS
        if unknown:
            yield (f"{where} has unknown keys {sorted(unknown)}; it takes {sorted(OPTIONS)}.")
        if not self.real_alias:
            yield (
                f'{where} has no "backend": name the TASKS backend that runs the tasks '
                '(for example "rq", an alias with BACKEND "django_tasks_rq.RQBackend").'
            )
        elif self.real_alias == self.alias:
            yield f'{where}["backend"] names this backend itself; name a real backend.'
        elif self.real_alias not in task_backends.settings:
            yield (
                f'{where}["backend"] is {self.real_alias!r}, which TASKS does not define '
                f"(it defines {', '.join(map(repr, task_backends.settings))})."
            )
        else:
            path = task_backends.settings[self.real_alias].get("BACKEND", "")
            real = _import(path)
            if isinstance(real, type) and issubclass(real, OutboxBackend):
                yield (
                    f'{where}["backend"] is {self.real_alias!r}, another outbox backend; '
                    "name the backend that runs the tasks."
                )
        spec = conf.OUTBOX_DESTINATIONS.get(self.destination)
        backend = spec.get("BACKEND") if isinstance(spec, dict) else None
        if spec is None:
            yield (
                f"IDEMPOTENCY_OUTBOX_DESTINATIONS has no {self.destination!r} destination, "
                f"which TASKS[{self.alias!r}] sends its tasks to: add "
                f'{{{self.destination!r}: {{"BACKEND": {TASKS_DESTINATION!r}}}}}, or name '
                f'another in {where}["destination"].'
            )
        elif isinstance(backend, str) and not _is_tasks_destination(backend):
            yield (
                f"IDEMPOTENCY_OUTBOX_DESTINATIONS[{self.destination!r}], where "
                f"TASKS[{self.alias!r}] sends its tasks, has BACKEND {backend!r}; it must "
                f"be {TASKS_DESTINATION!r} (or a subclass)."
            )

    def validate_task(self, task: Task[..., Any]) -> None:
        # What the real backend refuses (an unknown queue, a deferral it cannot do) is
        # refused now, at enqueue, not by the relay after commit.
        self.real.validate_task(task)

    def enqueue(
        self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]
    ) -> TaskResult[P, R]:
        """Write the task into the outbox, in the current transaction (NotInTransaction
        outside ``transaction.atomic()``); its TaskResult's id is the message id."""
        self.validate_task(task)
        real = str(self.real_alias)
        try:
            alias = in_transaction(self.using)
        except NotInTransaction as exc:
            raise NotInTransaction(
                f"{task.module_path}.enqueue() goes through the outbox (TASKS[{self.alias!r}]), "
                "which writes the task in the current transaction, and there is none: call it "
                "inside transaction.atomic() (a protected view or an exactly-once task already "
                f"is), or enqueue it on {real!r} directly where no transaction is wanted."
            ) from exc
        now = timezone.now()
        options: dict[str, Any] = {
            "destination": self.destination,
            "backend": real,
            "queue": task.queue_name,
            "priority": task.priority,
        }
        if task.run_after is not None:
            # Counted from the enqueue, as enqueue_task's countdown (and the redrive) are.
            options["countdown"] = max((task.run_after - now).total_seconds(), 0.0)
        message_id = write_message(
            alias,
            OutboxMessage.Kind.TASK,
            task.module_path,
            list(args),
            dict(kwargs),
            None,
            options,
        )
        return TaskResult(
            task=task,
            id=message_id,
            status=TaskResultStatus.READY,
            enqueued_at=now,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=list(args),
            kwargs=dict(kwargs),
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )


def _import(path: str) -> Any:
    try:
        return import_string(path)
    except ImportError:
        return None  # the Tasks framework's own check names it


def _is_tasks_destination(path: str) -> bool:
    """Whether the class at ``path`` is the Tasks destination or a subclass, told by its
    classes' paths: the destinations sit above the outbox, which imports none of them."""
    found = _import(path)
    return isinstance(found, type) and any(
        f"{cls.__module__}.{cls.__qualname__}" == TASKS_DESTINATION for cls in found.__mro__
    )
