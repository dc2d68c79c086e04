"""The Celery destination (the default): each message sent as ``app.send_task()`` would, with
the message id as task id, on one producer, a Redis batch as one pipeline (``celery_broker``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.messaging.destinations import Destination, PublishResult, Stopping
from django_idempotency.messaging.destinations.celery_broker import Broker, celery_app
from django_idempotency.messaging.outbox import task_name
from django_idempotency.messaging.outbox.leases import Message

logger = logging.getLogger("django_idempotency.relay")
# Task names a Celery destination's app did not know, already named in a warning.
_unknown: set[str] = set()


class CeleryDestination(Destination):
    """Publishes to the broker of a Celery app: ``OPTIONS["app"]`` (a dotted path), else the
    relay's app (``IDEMPOTENCY_OUTBOX_CELERY_APP``, else Celery's current app)."""

    redrives = True

    def __init__(self, name: str, options: Mapping[str, Any], *, app: Any = None) -> None:
        self.name = name
        path = options.get("app")
        self.app = import_string(path) if path else (app if app is not None else celery_app())
        self.broker = Broker(self.app, name)
        self._principals: dict[str, str | None] = {}
        self._tasks_imported = False

    @classmethod
    def validate(cls, name: str, options: Mapping[str, Any]) -> None:
        unknown = set(options) - {"app"}
        if unknown:
            raise ImproperlyConfigured(
                f"The Celery outbox destination {name!r} has unknown OPTIONS {sorted(unknown)}; "
                'it takes "app" (a dotted path to a Celery app) only.'
            )

    def open(self) -> None:
        self.broker.producer()

    def consumer_principal(self, kind: int, name: str) -> str | None:
        """The records' principal of the exactly-once task of this app that consumes such a
        message; None when its task is not exactly-once, or not known to this app."""
        called = task_name(kind, name)
        with contextlib.suppress(KeyError):
            return self._principals[called]
        from django_idempotency.messaging.consumers.celery import (
            ExactlyOnceTask,
            consumer_principal,
        )

        self.import_tasks()
        task = self.app.tasks.get(called)
        if task is None and called not in _unknown:
            _unknown.add(called)  # said once per process, not per relay
            logger.warning(
                "Task %s is not registered in the Celery app %r of outbox destination %r, so "
                "its messages are never published again if the broker loses them.",
                called,
                self.app.main,
                self.name,
            )
        found = consumer_principal(task) if isinstance(task, ExactlyOnceTask) else None
        self._principals[called] = found
        return found

    def import_tasks(self) -> None:
        """Import the project's task modules (Celery's autodiscovery), which the relay has
        no other reason to import, once; before a running relay's first pass, so that the
        first batch is not held up by it."""
        if self._tasks_imported:
            return
        self._tasks_imported = True
        try:
            self.app.loader.import_default_modules()
        except Exception:  # the worker fails on it too; the relay still publishes
            logger.exception("The relay could not import the project's Celery tasks.")

    def describe(self) -> str:
        return f"Celery app {self.app.main!r} to {self.broker.url()}"

    def close(self) -> None:
        self.broker.close()

    def is_connection_error(self, exc: Exception) -> bool:
        return self.broker.is_connection_error(exc)

    def publish(self, messages: Sequence[Message], stopping: Stopping) -> PublishResult:
        """Publish in order until one fails.

        Where the transport can (Redis), the publishes go out as one pipeline when the loop
        ends; if that fails, whether any arrived is unknown, so none counts as published.
        """
        done = PublishResult()
        producer = self.broker.producer()
        sender = self.broker.sender()
        batching = getattr(producer, "batch", None)  # kombu 5.7+
        # Large enough that the batch is flushed once, at the end.
        context = (
            batching(max_size=4 * len(messages) + 16) if batching else contextlib.nullcontext()
        )
        try:
            with context:
                for message in messages:
                    if stopping.is_set():
                        break
                    try:
                        self.broker.publish(message, sender)
                    except Exception as exc:
                        done.failed, done.error = message, exc
                        break
                    done.sent.append(message)
        except Exception as exc:
            if not done.sent:
                raise
            return PublishResult([], done.sent[0], exc)
        return done
