"""Exactly-once Celery consumers: ``ExactlyOnceTask`` claims ``(consumer, task id)``, runs the
body and stores its JSON result in one transaction, through the framework-neutral core
(``exactly_once``); a message goes back to the broker as ``Reject(requeue=True)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from celery import Task
from celery.exceptions import Reject

from django_idempotency.messaging.consumers.exactly_once import Delivery, consume, principal
from django_idempotency.messaging.tracing import broker_system, consume_span

__all__ = ["ExactlyOnceTask", "consumer_principal", "run_exactly_once"]

# A delivery that found the store down waits this long before giving the message back, so
# an outage does not spin every worker through the broker.
STORE_DOWN_PAUSE = 1.0

# Every ExactlyOnceTask class Celery made (one per task), for the system check.
declared: list[type[ExactlyOnceTask]] = []


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:  # Celery's Task takes type arguments at run time only from 5.7 on
    _TaskBase = Task


class ExactlyOnceTask(_TaskBase):
    """A Celery task that takes effect once per message id, however often it is delivered.

    Use it as ``@shared_task(base=ExactlyOnceTask, bind=True)``. The body runs inside a
    transaction on the records' database together with the claim of
    ``(consumer_name, task id)``; its return value must be JSON and is stored, and a
    redelivery returns it without running the body. ``acks_late`` and
    ``reject_on_worker_lost`` are on, and the check ``django_idempotency.E010`` refuses a
    task that turns them off.
    """

    acks_late = True
    reject_on_worker_lost = True
    # Message ids are scoped by consumer: by default the task's name.
    consumer_name: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared.append(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        # Called as a plain function (no message): nothing to deduplicate on.
        if request.called_directly or not request.id:
            return super().__call__(*args, **kwargs)
        with consume_span(request, self.name, broker_system(self.app.conf.broker_url)):
            return run_exactly_once(self, str(request.id), args, kwargs)


def consumer_principal(task: Task[Any, Any]) -> str:
    return principal(getattr(task, "consumer_name", None) or task.name)


def run_exactly_once(
    task: Task[Any, Any], message_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``task``'s body for one delivery of ``message_id``, exactly once."""
    return consume(
        Delivery(
            consumer=getattr(task, "consumer_name", None) or task.name,
            message_id=message_id,
            name=task.name,
            args=args,
            kwargs=kwargs,
            run=lambda: task.run(*args, **kwargs),
            give_back=_reject,
            pause=STORE_DOWN_PAUSE,
            sender=type(task),
            context=task.request,
        )
    )


def _reject(exc: Exception) -> NoReturn:
    raise Reject(exc, requeue=True) from exc
