"""Exactly-once Celery consumers: ``ExactlyOnceTask`` claims ``(consumer, task id)``, runs the
body and stores its JSON result in one transaction (docs/side-effects.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Reject
from django.core.serializers.json import DjangoJSONEncoder
from django.db import InterfaceError, OperationalError

from django_idempotency.conf import conf
from django_idempotency.engine.errors import (
    InProgress,
    KeyExpired,
    Misconfigured,
    StoreUnavailable,
)
from django_idempotency.engine.unit import UnitOfWork
from django_idempotency.engine.work import Refuse, Replay, Result, Work
from django_idempotency.messaging.tracing import consuming
from django_idempotency.models import IdempotencyRecord

logger = logging.getLogger("django_idempotency.consumers")

METHOD = IdempotencyRecord.CONSUMER_METHOD
PRINCIPAL_PREFIX = "consumer:"
JSON_HEADERS = [["content-type", "application/json"]]
# Records' key and scope columns hold this many characters; longer ones are hashed.
MAX_IDENTITY = 255
# A delivery that found the store down waits this long before giving the message back, so
# an outage does not spin every worker through the broker.
STORE_DOWN_PAUSE = 1.0
# Made once: json.dumps() builds an encoder on every call. Stateless, so threads share them.
CANONICAL_JSON = DjangoJSONEncoder(sort_keys=True, separators=(",", ":"))
COMPACT_JSON = DjangoJSONEncoder(separators=(",", ":"))

# Every ExactlyOnceTask class Celery made (one per task), for the system check.
declared: list[type[ExactlyOnceTask]] = []


class ExactlyOnceTask(Task[Any, Any]):
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
        with consuming(request, self.name):
            return consume(self, str(request.id), args, kwargs)


def consumer_principal(task: Task[Any, Any]) -> str:
    name = getattr(task, "consumer_name", None) or task.name
    return _bounded(PRINCIPAL_PREFIX + name)


def _bounded(value: str) -> str:
    if len(value) <= MAX_IDENTITY:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def arguments_digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    canonical = CANONICAL_JSON.encode([list(args), kwargs])
    return hashlib.sha256(canonical.encode()).hexdigest()


def consume(
    task: Task[Any, Any], message_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``task``'s body for one delivery of ``message_id``, exactly once."""
    work = Work(
        principal=consumer_principal(task),
        key=_bounded(message_id),
        method=METHOD,
        path=task.name,
        fingerprint={"arguments": arguments_digest(args, kwargs)},
        ttl=conf.CONSUMER_TTL,
    )
    unit = UnitOfWork(
        work, wait=conf.CONSUMER_WAIT, sender=type(task), context=task.request, kind="task"
    )
    try:
        decision = unit.open()
    except StoreUnavailable as exc:
        _give_back(task, message_id, exc)
    except Misconfigured as exc:
        # The engine logged the fix. The deployment is at fault, not the message: it stays
        # with the broker, and runs once the database runs at READ COMMITTED.
        _give_back(task, message_id, exc, "cannot run at this database's isolation level")
    if isinstance(decision, Replay):
        logger.info("Task %s[%s] already ran; acknowledged with its result.", task.name, message_id)
        return json.loads(decision.sent_body() or b"null")
    if isinstance(decision, Refuse):
        return _refused(task, message_id, decision)
    try:
        result = task.run(*args, **kwargs)
        body = COMPACT_JSON.encode(result).encode()
    except BaseException as exc:
        # Retry, Reject, any error, SystemExit: nothing of this delivery stays.
        try:
            unit.fail(exc)
        except StoreUnavailable as lost:  # the rollback found the database gone
            _give_back(task, message_id, lost)
        if isinstance(exc, (OperationalError, InterfaceError)):
            # The database went away under the body (restarted, the connection cut): as
            # when the claim finds it down, the message goes back to the broker instead of
            # being acknowledged as failed, which would lose it.
            _give_back(task, message_id, exc)
        raise
    try:
        unit.close(Result(200, JSON_HEADERS, body))
    except StoreUnavailable as exc:
        # Nothing was committed; the broker redelivers.
        raise Reject(exc, requeue=True) from exc
    return result


def _give_back(
    task: Task[Any, Any],
    message_id: str,
    exc: Exception,
    why: str = "found the idempotency store unavailable",
) -> NoReturn:
    logger.warning(
        "Task %s[%s] %s; the message goes back to the broker.", task.name, message_id, why
    )
    time.sleep(STORE_DOWN_PAUSE)
    raise Reject(exc, requeue=True) from exc


def _refused(task: Task[Any, Any], message_id: str, decision: Refuse) -> Any:
    error = decision.error
    if isinstance(error, InProgress):
        # Another delivery of this message still holds the claim: give it back to the
        # broker, which redelivers it; by then the holder has committed (a replay) or
        # died (a run).
        logger.info(
            "Task %s[%s] is running in another delivery; the message goes back to the broker.",
            task.name,
            message_id,
        )
        raise Reject(error, requeue=True)
    if isinstance(error, KeyExpired):
        logger.warning(
            "Task %s[%s] ran before and its record has expired; acknowledged without running "
            "it again. Raise IDEMPOTENCY_CONSUMER_TTL above the broker's redelivery window.",
            task.name,
            message_id,
        )
        return None
    if isinstance(error, Misconfigured):
        # Its stored result is sealed under a key no longer listed: it ran, and runs again
        # never; the message waits with the broker until the key is listed again.
        _give_back(task, message_id, error, "has a stored result no listed key opens")
    # KeyReused: the same message id with other arguments is not a redelivery.
    logger.error(
        "Task %s[%s] was delivered again with different arguments; it was not run.",
        task.name,
        message_id,
    )
    raise error
