"""The Celery destination's transport: the relay's Celery app, its connection and producer,
and ``TaskSender``, which sends outbox rows as ``app.send_task()`` would, at the broker's
pace (``docs/outbox.md``)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery import _state, current_app
from celery.app.routes import MapRoute
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from kombu import Queue
from kombu.common import Broadcast
from kombu.exceptions import OperationalError

from django_idempotency.conf import conf
from django_idempotency.messaging.outbox import task_name
from django_idempotency.messaging.outbox.leases import Message
from django_idempotency.messaging.tracing import broker_system, publish_span
from django_idempotency.models import OutboxMessage


def celery_app() -> Any:
    """The Celery app the relay publishes with: ``IDEMPOTENCY_OUTBOX_CELERY_APP``, else the
    current app, the project's once its ``celery.py`` is imported. Never Celery's own
    default app, whose broker no worker of the project reads (ImproperlyConfigured)."""
    path = conf.OUTBOX_CELERY_APP
    current = current_app._get_current_object  # type: ignore[attr-defined]
    app = import_string(path) if path else current()
    if celerys_default(app):
        raise ImproperlyConfigured(
            f"The relay's Celery app is Celery's default app ({app.main!r}, broker "
            f"{broker_of(app)}), not the project's: the project's celery.py was never "
            "imported, so the relay would publish where no worker of the project reads. "
            "Import it in the project package's __init__.py (`from .celery import app as "
            "celery_app`, as Celery's Django guide shows), or set "
            "IDEMPOTENCY_OUTBOX_CELERY_APP to its dotted path, such as "
            '"myproject.celery.app".'
        )
    return app


def celerys_default(app: Any) -> bool:
    """Whether ``app`` is the app Celery makes for itself when none was made (or set as
    current in this thread)."""
    fallback = getattr(_state, "default_app", None)  # made on first need, so read it now
    return app is fallback and getattr(app, "main", None) == "default"


def broker_of(app: Any) -> str:
    """The app's broker URL to publish to, without its password."""
    # A Connection is only a description until it is used: nothing connects here.
    return str(app.connection_for_write().as_uri())


def require_publisher_confirms(app: Any) -> None:
    """On RabbitMQ, publish in confirm mode: a publish returns once the broker has the message.

    Done before the relay opens its connection; Redis answers every command anyway.
    """
    url = str(app.conf.broker_write_url or app.conf.broker_url or "")
    if url.split("://", 1)[0] in {"amqp", "pyamqp", "amqps"}:
        options = dict(app.conf.broker_transport_options or {})
        options.setdefault("confirm_publish", True)
        app.conf.broker_transport_options = options


class Broker:
    """One connection and producer to the app's broker, kept between passes and replaced
    after an error."""

    def __init__(self, app: Any, destination: str = "default") -> None:
        require_publisher_confirms(app)
        self.app = app
        # The destination's name in IDEMPOTENCY_OUTBOX_DESTINATIONS, for the publish span.
        self.destination = destination
        self.system = broker_system(self.url())  # messaging.system of the publish spans
        self._connection: Any = None
        self._producer: Any = None

    def url(self) -> str:
        return broker_of(self.app)

    def producer(self) -> Any:
        if self._producer is None:
            self._connection = self.app.connection_for_write()
            self._connection.ensure_connection(max_retries=1)
            self._producer = self.app.amqp.Producer(self._connection, auto_declare=False)
        return self._producer

    def sender(self) -> TaskSender:
        """What publishes on the producer; made once per pass."""
        return TaskSender(self.app, self.producer())

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
        self._connection = self._producer = None

    def is_connection_error(self, exc: Exception) -> bool:
        """Whether ``exc`` says the broker is out of reach, rather than refusing a message."""
        errors: tuple[type[BaseException], ...] = (OperationalError, OSError)
        if self._connection is not None:
            errors += tuple(self._connection.connection_errors)
        # A failed Redis pipeline wraps the connection error that failed it.
        return isinstance(exc, errors) or isinstance(exc.__cause__, errors)

    def publish(self, message: Message, sender: TaskSender) -> None:
        """Send one claimed row as its task (an event as the event task), under its own id."""
        if message.kind == OutboxMessage.Kind.EVENT:
            args, kwargs = [message.name, message.payload], {}
        else:
            args, kwargs = message.args, message.kwargs
        name = task_name(message.kind, message.name)
        countdown = message.options.get("countdown")
        # From the enqueue, not from now: a relay that was late does not delay it further.
        eta = None if countdown is None else message.created_at + timedelta(seconds=countdown)
        queue = message.options.get("queue")
        options, system = message.options, self.system
        with publish_span(message.id, name, options, self.destination, system) as headers:
            sender.send(
                name, args, kwargs, task_id=message.id, queue=queue, eta=eta, headers=headers
            )


def argument_repr(
    value: list[Any] | tuple[Any, ...] | dict[str, Any], maxsize: int, maxlevels: int
) -> str:
    """Celery's ``saferepr(value, maxsize, maxlevels)`` of JSON arguments, from ``repr()``
    where the two agree.

    They agree when the text is short enough not to be cut, no container is nested deeper
    than ``maxlevels``, and no string needed quoting other than ``'…'`` (a repr without ``"``
    or a backslash: saferepr quotes and escapes strings its own way).
    """
    text = repr(value)
    if len(text) < maxsize and '"' not in text and "\\" not in text:
        # No more brackets than levels cannot nest deeper (strings' brackets only add some).
        if not maxlevels or text.count("[") + text.count("{") <= maxlevels:
            return text
        if _nested_within(value, maxlevels):
            return text
    return saferepr(value, maxsize, maxlevels=maxlevels)


def _nested_within(value: list[Any] | tuple[Any, ...] | dict[str, Any], levels: int) -> bool:
    # JSON's containers, ``value`` itself counting as one level, as saferepr counts them.
    children = value.values() if isinstance(value, dict) else value
    return levels > 0 and all(
        _nested_within(child, levels - 1) for child in children if isinstance(child, (dict, list))
    )


@dataclass(frozen=True)
class _Route:
    """Where a call goes and how, as ``send_task()`` works it out (never changed once made)."""

    options: dict[str, Any]
    time_limit: float | None
    soft_time_limit: float | None


class TaskSender:
    """Sends task calls on one producer, as ``app.send_task()`` would; one per pass."""

    def __init__(self, app: Any, producer: Any) -> None:
        amqp = app.amqp
        self.app = app
        self.producer = producer
        self.create_message = amqp.create_task_message
        self.send_message = amqp.send_task_message
        self.router = amqp.router
        # Routes from task_routes mappings depend on the task's name alone; a function's may
        # depend on the arguments, and is asked for every message.
        self.routes_by_name = all(isinstance(route, MapRoute) for route in self.router.routes)
        self.args_maxsize = int(amqp.argsrepr_maxsize)
        self.kwargs_maxsize = int(amqp.kwargsrepr_maxsize)
        # Older Celery has no such setting: its saferepr went three levels deep.
        self.maxlevels = int(app.conf.get("task_repr_maxlevels", 3))
        self.sent_event = bool(app.conf.task_send_sent_event)
        self.reply_to = app.thread_oid
        self.origin = anon_nodename()
        # Inside a worker's task, send_task() makes each message that task's child.
        self.in_task = app.current_worker_task is not None
        self.reraise = producer.connection._reraise_as_library_errors
        self._tasks: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._routes: dict[tuple[str, str | None], _Route] = {}
        self._bound: dict[Queue, Queue] = {}

    def send(
        self,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        *,
        task_id: str,
        queue: str | None = None,
        eta: datetime | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``headers``: more message headers (a trace context), read as the task request's
        attributes."""
        task_type, task_options = self._task(name)
        if eta is not None or self.in_task or "expires" in task_options:
            self.app.send_task(
                name, args=args, kwargs=kwargs, task_id=task_id, producer=self.producer,
                queue=queue, eta=eta, retry=False, add_to_parent=False,
                headers=dict(headers) if headers else None,
            )  # fmt: skip
            return
        try:
            self._send(name, args, kwargs, task_id, queue, task_type, task_options, headers)
        except Exception:
            # Turned into kombu's errors as send_task() turns them, by the same context
            # manager, entered only then: around every message it costs microseconds.
            with self.reraise():
                raise

    def _send(
        self,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        task_id: str,
        queue: str | None,
        task_type: Any,
        task_options: dict[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        route = self._routes.get((name, queue))
        if route is None:
            route = self._route(name, args, kwargs, queue, task_type, task_options)
            if self.routes_by_name:
                self._routes[name, queue] = route
        # As create_task_message makes them before its repr.
        call_args: list[Any] | tuple[()] = args or ()
        call_kwargs = kwargs or {}
        message = self.create_message(
            task_id,
            name,
            call_args,
            call_kwargs,
            reply_to=self.reply_to,
            time_limit=route.time_limit,
            soft_time_limit=route.soft_time_limit,
            create_sent_event=self.sent_event,
            ignore_result=None,  # what send_task() passes when nobody asked
            argsrepr=argument_repr(call_args, self.args_maxsize, self.maxlevels),
            kwargsrepr=argument_repr(call_kwargs, self.kwargs_maxsize, self.maxlevels),
            origin=self.origin,
            **route.options,
        )
        options = route.options
        if headers:
            options = {**options, "headers": {**options.get("headers", {}), **headers}}
        self.send_message(self.producer, name, message, retry=False, **options)

    def _task(self, name: str) -> tuple[Any, dict[str, Any]]:
        """The task registered under ``name`` (or None) and its options, as send_task()
        merges them."""
        found = self._tasks.get(name)
        if found is None:
            task_type = self.app._tasks.get(name)
            get_options = getattr(task_type, "_get_exec_options", None)
            options = get_options() if inspect.ismethod(get_options) else None
            chosen = {k: v for k, v in (options or {}).items() if v is not None}
            found = self._tasks[name] = (task_type, chosen)
        return found

    def _route(
        self,
        name: str,
        args: list[Any],
        kwargs: dict[str, Any],
        queue: str | None,
        task_type: Any,
        task_options: dict[str, Any],
    ) -> _Route:
        options = dict(task_options)
        if queue is not None:
            options["queue"] = queue
        # send_task() passes the task's time limits as arguments, not as options.
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        options = self.router.route(options, name, args, kwargs, task_type)
        routed = options.get("queue")
        if (
            isinstance(routed, Queue)
            and not isinstance(routed, Broadcast)
            and "declare" not in options
        ):
            options["queue"], options["declare"] = self._declare(routed)
        return _Route(options, time_limit, soft_time_limit)

    def _declare(self, queue: Queue) -> tuple[Queue, tuple[Queue, ...]]:
        """The queue bound to the channel, and what to declare with each message."""
        # Bound once: kombu would copy and bind it for every message before even looking at
        # its cache of what this connection declared.
        bound = self._bound.get(queue)
        if bound is None:
            bound = self._bound[queue] = queue(self.producer.channel)
        if not bound.can_cache_declaration:
            return bound, (bound,)  # auto-delete or expiring: kombu declares it every time
        # Declared here, before its first message, as kombu would; its cache makes that
        # once per connection, and the messages then skip the declaration altogether.
        self.producer.maybe_declare(bound)
        return bound, ()
