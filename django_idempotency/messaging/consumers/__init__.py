"""The consumers: each runs a delivered message's work once, through the exactly-once core
(``exactly_once``): ``celery`` (``ExactlyOnceTask``), ``nats`` (``NatsConsumer``) and ``tasks``
(``deliver``, for Django's Tasks framework).

``ExactlyOnceTask`` and its helpers are importable from here, as they always were. They load on
first use, so that the NATS and Tasks consumers need no Celery, an optional extra."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from django_idempotency.messaging.consumers.exactly_once import (
    JSON_HEADERS,
    METHOD,
    PRINCIPAL_PREFIX,
    arguments_digest,
)

if TYPE_CHECKING:
    from django_idempotency.messaging.consumers.celery import (
        ExactlyOnceTask,
        consumer_principal,
        run_exactly_once,
    )

__all__ = [
    "JSON_HEADERS",
    "METHOD",
    "PRINCIPAL_PREFIX",
    "ExactlyOnceTask",
    "arguments_digest",
    "consumer_principal",
    "run_exactly_once",
]


def __getattr__(name: str) -> Any:
    # Only Celery's names reach here (the rest are bound above): any other name, asked for by
    # hasattr() or a tool, never imports Celery.
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.celery"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
