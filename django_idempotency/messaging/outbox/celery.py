"""``OutboxTask``: a Celery task base whose ``delay()`` and ``apply_async()`` go through the
outbox inside a protected unit of work, and straight to the broker outside one."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from celery import Task
from celery.result import AsyncResult

from django_idempotency.engine.keyless import current_keyless
from django_idempotency.engine.unit import current_unit
from django_idempotency.messaging.outbox import OutboxError, enqueue_task

# What the outbox keeps of a call's options; countdown and eta become its countdown.
OUTBOX_OPTIONS = frozenset({"queue", "countdown", "eta", "ordering_key"})


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:  # Celery's Task takes type arguments at run time only from 5.7 on
    _TaskBase = Task


class OutboxTask(_TaskBase):
    """Set as ``base=`` on a task (or as the app's ``task_cls``) to move its existing
    ``.delay()`` calls onto the outbox without editing them: inside a protected view or an
    exactly-once task the call becomes a row in the same transaction (published if and only
    if it commits, with its message id as task id); anywhere else it is sent at once, as
    before."""

    abstract = True

    def apply_async(  # type: ignore[override]
        self,
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult[Any]:
        # A protected view's request, with a key or without one, or an exactly-once task.
        unit = current_unit.get() or current_keyless.get()
        # The outbox's own option: a call sent at once goes out in call order, as before.
        ordering_key = options.pop("ordering_key", None)
        if unit is None:
            return super().apply_async(tuple(args) if args is not None else None, kwargs, **options)
        unknown = sorted(set(options) - OUTBOX_OPTIONS)
        if unknown:
            raise OutboxError(
                f"{self.name}.apply_async() inside a unit of work goes through the outbox, "
                f"which keeps only queue, countdown and eta, not {', '.join(unknown)}: "
                "call it outside the unit of work, or drop those options."
            )
        message_id = enqueue_task(
            self.name,
            tuple(args or ()),
            kwargs,
            queue=options.get("queue"),
            countdown=_countdown(options.get("countdown"), options.get("eta")),
            ordering_key=ordering_key,
            using=unit.using,
        )
        return self.AsyncResult(message_id)


def _countdown(countdown: float | None, eta: datetime | None) -> float | None:
    if eta is None:
        return countdown
    if countdown is not None:
        raise OutboxError("apply_async() takes countdown or eta, not both.")
    moment = eta if eta.tzinfo else eta.replace(tzinfo=UTC)
    return max((moment - datetime.now(UTC)).total_seconds(), 0.0)
