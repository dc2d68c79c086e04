"""The exactly-once consumer core, framework-neutral: claim ``(consumer, message id)``, run the
body and store its JSON result in one transaction, replay on redelivery (docs/side-effects.md).

A front end (Celery's ``ExactlyOnceTask``, the ``django.tasks`` runner, a stream consumer) says
only how its body runs and how it gives a message back to its transport::

    result = consume(Delivery(
        consumer="billing.capture",          # message ids are scoped by it
        message_id=message_id,               # stable across redeliveries
        name="billing.capture",              # the record's path, and the logs'
        args=args, kwargs=kwargs,            # a redelivery must carry the same (KeyReused)
        run=lambda: capture(*args, **kwargs),
        give_back=redeliver,                 # raises what makes the transport deliver again
    ))

``consume()`` returns the body's result (or the first delivery's stored result), or raises:
what ``give_back`` raises when the message must be delivered again (the store is down, another
delivery holds it, its stored result cannot be opened), the body's own exception (nothing of
the delivery stays), or ``KeyReused`` (the same id with other arguments: not a redelivery).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from django.core.serializers.json import DjangoJSONEncoder
from django.db import InterfaceError, OperationalError

from django_idempotency.conf import conf
from django_idempotency.engine.errors import (
    InProgress,
    KeyExpired,
    Misconfigured,
    StoreUnavailable,
)
from django_idempotency.engine.fingerprints import plain_parts
from django_idempotency.engine.unit import UnitOfWork
from django_idempotency.engine.work import Refuse, Replay, Result, Work
from django_idempotency.models import IdempotencyRecord

logger = logging.getLogger("django_idempotency.consumers")

METHOD = IdempotencyRecord.CONSUMER_METHOD
PRINCIPAL_PREFIX = "consumer:"
JSON_HEADERS = [["content-type", "application/json"]]
# Records' key and scope columns hold this many characters; longer ones are hashed.
MAX_IDENTITY = 255
# Made once: json.dumps() builds an encoder on every call. Stateless, so threads share them.
CANONICAL_JSON = DjangoJSONEncoder(sort_keys=True, separators=(",", ":"))
COMPACT_JSON = DjangoJSONEncoder(separators=(",", ":"))


@dataclass(frozen=True)
class Delivery:
    """One delivery of a message to an exactly-once consumer, as its front end sees it.

    ``give_back(exc)`` must raise (whatever makes the transport deliver the message again:
    Celery's ``Reject(requeue=True)``, a failed job that the relay's redrive publishes again, a
    negative acknowledgement). ``pause``: seconds to wait before a give-back caused by the
    store, so that an outage does not spin every worker through a broker that redelivers at
    once. ``sender`` and ``context`` go to the engine's signals (``kind="task"``).
    """

    consumer: str
    message_id: str
    name: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    run: Callable[[], Any]
    give_back: Callable[[Exception], NoReturn]
    pause: float = 0.0
    sender: type = object
    context: Any = field(default=None)


def principal(consumer: str) -> str:
    """The records' principal of a consumer name."""
    return bounded(PRINCIPAL_PREFIX + consumer)


def bounded(value: str) -> str:
    if len(value) <= MAX_IDENTITY:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def _arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, bytes]:
    # What the fingerprint's one part digests: the arguments' canonical JSON.
    return {"arguments": CANONICAL_JSON.encode([list(args), kwargs]).encode()}


def arguments_digest(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The plain SHA-256 of the arguments' canonical JSON: the fingerprint of a consumer's
    record stored before fingerprints were keyed (a redelivery of one still compares)."""
    return plain_parts(_arguments(args, kwargs))["arguments"]


def consume(delivery: Delivery) -> Any:
    """Run ``delivery``'s body for its message id, exactly once (the module's docstring)."""
    work = Work(
        principal=principal(delivery.consumer),
        key=bounded(delivery.message_id),
        method=METHOD,
        path=delivery.name,
        # Keyed by the unit when it opens: no digest to test guesses of the arguments on.
        fingerprint={},
        ttl=conf.CONSUMER_TTL,
        messages=_arguments(delivery.args, delivery.kwargs),
    )
    unit = UnitOfWork(
        work,
        wait=conf.CONSUMER_WAIT,
        sender=delivery.sender,
        context=delivery.context,
        kind="task",
    )
    try:
        decision = unit.open()
    except StoreUnavailable as exc:
        _give_back(delivery, exc)
    except Misconfigured as exc:
        # The engine logged the fix. The deployment is at fault, not the message: it stays
        # with the transport, and runs once the database runs at READ COMMITTED.
        _give_back(delivery, exc, "cannot run at this database's isolation level")
    if isinstance(decision, Replay):
        logger.info(
            "Task %s[%s] already ran; acknowledged with its result.",
            delivery.name,
            delivery.message_id,
        )
        return json.loads(decision.sent_body() or b"null")
    if isinstance(decision, Refuse):
        return _refused(delivery, decision)
    try:
        result = delivery.run()
        body = COMPACT_JSON.encode(result).encode()
    except BaseException as exc:
        # Retry, Reject, any error, SystemExit: nothing of this delivery stays.
        try:
            unit.fail(exc)
        except StoreUnavailable as lost:  # the rollback found the database gone
            _give_back(delivery, lost)
        if isinstance(exc, (OperationalError, InterfaceError)):
            # The database went away under the body (restarted, the connection cut): as
            # when the claim finds it down, the message goes back to the transport instead
            # of being acknowledged as failed, which would lose it.
            _give_back(delivery, exc)
        raise
    try:
        unit.close(Result(200, JSON_HEADERS, body))
    except StoreUnavailable as exc:
        # Nothing was committed; the transport delivers it again.
        delivery.give_back(exc)
    return result


def _give_back(
    delivery: Delivery, exc: Exception, why: str = "found the idempotency store unavailable"
) -> NoReturn:
    logger.warning(
        "Task %s[%s] %s; the message goes back to the broker.",
        delivery.name,
        delivery.message_id,
        why,
    )
    if delivery.pause > 0:
        time.sleep(delivery.pause)
    delivery.give_back(exc)


def _refused(delivery: Delivery, decision: Refuse) -> Any:
    error = decision.error
    if isinstance(error, InProgress):
        # Another delivery of this message still holds the claim: give it back, to be
        # delivered again; by then the holder has committed (a replay) or died (a run).
        logger.info(
            "Task %s[%s] is running in another delivery; the message goes back to the broker.",
            delivery.name,
            delivery.message_id,
        )
        delivery.give_back(error)
    if isinstance(error, KeyExpired):
        logger.warning(
            "Task %s[%s] ran before and its record has expired; acknowledged without running "
            "it again. Raise IDEMPOTENCY_CONSUMER_TTL above the broker's redelivery window.",
            delivery.name,
            delivery.message_id,
        )
        return None
    if isinstance(error, Misconfigured):
        # Its stored result is sealed under a key no longer listed: it ran, and runs again
        # never; the message waits with the transport until the key is listed again.
        _give_back(delivery, error, "has a stored result no listed key opens")
    # KeyReused: the same message id with other arguments is not a redelivery.
    logger.error(
        "Task %s[%s] was delivered again with different arguments; it was not run.",
        delivery.name,
        delivery.message_id,
    )
    raise error
