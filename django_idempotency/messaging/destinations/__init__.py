"""Destinations: where the relay publishes each message, chosen by its kind and name from
``IDEMPOTENCY_OUTBOX_ROUTES`` among ``IDEMPOTENCY_OUTBOX_DESTINATIONS`` (``docs/outbox.md``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.conf import conf
from django_idempotency.messaging.outbox.leases import Message
from django_idempotency.messaging.routing import CELERY, DEFAULT, TASKS
from django_idempotency.messaging.routing import NATS as NATS
from django_idempotency.models import OutboxMessage

# A route's pattern may start with one of these to match that kind of message only.
KIND_PREFIXES = {"task:": OutboxMessage.Kind.TASK, "event:": OutboxMessage.Kind.EVENT}


@dataclass
class PublishResult:
    """What a destination did with the messages it was given: those it has (acknowledged),
    and the first that failed, with its error; the others it was not sure of or never tried."""

    sent: list[Message] = field(default_factory=list)
    failed: Message | None = None
    error: Exception | None = None


# Its first name, which custom destinations' ``publish`` may still import and return.
Publication = PublishResult


class Stopping(Protocol):
    """What tells a destination to stop publishing a batch early: the relay stopping, or the
    batch's lease about to run out (``threading.Event`` is one)."""

    def is_set(self) -> bool: ...


# What ``publish_later`` returns: a call that waits for the outcome, as ``publish`` would
# have returned it.
Waiting = Callable[[], PublishResult]


class Destination:
    """Publishes claimed outbox messages somewhere, under their message ids: the base class of
    every destination, declaring all that the relay and the redrive ask of one, with defaults
    (as Django's ``BaseTaskBackend`` does for task backends). A destination subclasses it,
    sets its capabilities and implements ``open``, ``publish``, ``close`` and ``describe``."""

    # Whether the relay checks the exactly-once consumer's record of what it published here
    # (the redrive: Celery, and Django Tasks), through ``consumer_principal``; other
    # destinations' consumers keep none.
    redrives: bool = False
    # Whether it implements ``publish_later``: the relay then marks the previous batch and
    # claims the next while this one is in flight.
    pipelines: bool = False

    def __init__(self, name: str, options: Mapping[str, Any], *, app: Any = None) -> None:
        # ``options``: its OPTIONS, already validated; ``app``: the relay's Celery app, for
        # destinations that publish with Celery.
        self.name = name

    @classmethod
    def validate(cls, name: str, options: Mapping[str, Any]) -> None:
        """Raise ImproperlyConfigured, naming the fix, when ``options`` cannot work (E121
        shows it); connects to nothing. By default any OPTIONS are taken."""

    def consumer_principal(self, kind: int, name: str) -> str | None:
        """The records' principal under which the exactly-once consumer of such a message
        records it, found by this destination's own means (its Celery app's tasks, the
        Tasks runner's); None when no consumer records it. Asked only when ``redrives``."""
        return None

    def import_tasks(self) -> None:
        """Make ready, once, what ``consumer_principal`` reads (a Celery app's task modules),
        before a running relay's first pass; asked only when ``redrives``."""

    def open(self) -> None:
        """Connect, if not connected yet (the relay calls it before each batch)."""
        raise NotImplementedError

    def publish(self, messages: Sequence[Message], stopping: Stopping) -> PublishResult:
        """Publish in order; return once the destination has acknowledged what it counts as
        sent. Stop early (and say so) once ``stopping`` is set."""
        raise NotImplementedError

    def publish_later(self, messages: Sequence[Message], stopping: Stopping) -> Waiting:
        """Start publishing and return at once the wait for what ``publish`` would have
        returned; called instead of ``publish`` when ``pipelines``."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop the connection; the next ``open()`` makes a new one."""
        raise NotImplementedError

    def is_connection_error(self, exc: Exception) -> bool:
        """Whether ``exc`` says the destination is out of reach, rather than refusing a message."""
        return False

    def describe(self) -> str:
        """Where it publishes, for the relay's start line (no password)."""
        raise NotImplementedError


def start(destination: Destination, messages: Sequence[Message], stopping: Stopping) -> Waiting:
    """Start publishing ``messages`` (in the background where the destination can) and return
    the wait for its PublishResult; a failure to connect or send is a PublishResult that says so."""
    try:
        destination.open()
        if not destination.pipelines:
            done = destination.publish(messages, stopping)
            return lambda: done
        wait = destination.publish_later(messages, stopping)
    except Exception as exc:  # connecting failed: nothing went out
        failed = PublishResult([], messages[0], exc)
        return lambda: failed

    def outcome() -> PublishResult:
        try:
            return wait()
        except Exception as exc:  # the connection went, or no answer in time
            return PublishResult([], messages[0], exc)

    return outcome


def _spec(name: str, value: Any) -> tuple[str, Mapping[str, Any]]:
    if not isinstance(value, Mapping) or not isinstance(value.get("BACKEND"), str):
        raise ImproperlyConfigured(
            f"IDEMPOTENCY_OUTBOX_DESTINATIONS[{name!r}] is {value!r}; it must be a dict with "
            f'a "BACKEND" (a dotted path, such as {CELERY!r}) and optionally "OPTIONS".'
        )
    options = value.get("OPTIONS", {})
    if not isinstance(options, Mapping):
        raise ImproperlyConfigured(
            f'IDEMPOTENCY_OUTBOX_DESTINATIONS[{name!r}]["OPTIONS"] must be a dict.'
        )
    return value["BACKEND"], options


def backend(name: str, path: str) -> Any:
    """The class at ``path``; ImproperlyConfigured naming what is missing when it cannot be
    imported (an optional client library not installed, say)."""
    try:
        return import_string(path)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        extra = {
            "nats": " (the nats extra: django-idempotency[nats])",
            "django_tasks": " (the tasks extra: django-idempotency[tasks], or Django 6.0+)",
        }.get((missing or "").split(".")[0], "")
        raise ImproperlyConfigured(
            f"The outbox destination {name!r} cannot load its BACKEND {path!r}: {exc}{extra}."
        ) from exc


def configured() -> dict[str, tuple[type[Destination], Mapping[str, Any]]]:
    """The destinations of the settings as (class, options), each class imported and its
    options validated, without connecting; ImproperlyConfigured on the first problem."""
    found: dict[str, tuple[type[Destination], Mapping[str, Any]]] = {}
    destinations = conf.OUTBOX_DESTINATIONS
    if DEFAULT not in destinations:
        raise ImproperlyConfigured(
            f"IDEMPOTENCY_OUTBOX_DESTINATIONS has no {DEFAULT!r} destination, which takes "
            "every message that no route of IDEMPOTENCY_OUTBOX_ROUTES names (in a project "
            "without Celery whose messages all go to Django's Tasks framework, name that one "
            f'{DEFAULT!r}: {{{DEFAULT!r}: {{"BACKEND": {TASKS!r}}}}}).'
        )
    for name, value in destinations.items():
        path, options = _spec(name, value)
        cls = backend(name, path)
        if not (isinstance(cls, type) and issubclass(cls, Destination)):
            raise ImproperlyConfigured(
                f"The BACKEND {path!r} of outbox destination {name!r} is no subclass of "
                "django_idempotency.messaging.destinations.Destination: derive it from that "
                "class, which declares what the relay asks of a destination."
            )
        cls.validate(name, options)
        found[name] = (cls, options)
    for pattern, target in conf.OUTBOX_ROUTES.items():
        if not isinstance(pattern, str) or target not in found:
            raise ImproperlyConfigured(
                f"IDEMPOTENCY_OUTBOX_ROUTES[{pattern!r}] names the destination {target!r}, "
                f"which IDEMPOTENCY_OUTBOX_DESTINATIONS does not define "
                f"(it defines {', '.join(map(repr, found))})."
            )
    return found


def route(kind: int, name: str) -> str:
    """The destination of a message: the first route whose pattern matches its name (a
    pattern starting with ``task:`` or ``event:`` matches that kind only), else default."""
    for pattern, target in conf.OUTBOX_ROUTES.items():
        wanted = next(
            (k for prefix, k in KIND_PREFIXES.items() if pattern.startswith(prefix)), None
        )
        if wanted is not None:
            if wanted != kind:
                continue
            pattern = pattern.split(":", 1)[1]
        if fnmatchcase(name, pattern):
            return str(target)
    return DEFAULT


class Destinations:
    """The relay's destinations, made once from the settings, and each message's own."""

    def __init__(self, *, app: Any = None) -> None:
        # ``app``: the Celery app the relay was given, for destinations that publish with Celery.
        self.by_name: dict[str, Destination] = {
            name: cls(name, options, app=app) for name, (cls, options) in configured().items()
        }
        self._routes: dict[tuple[int, str], Destination] = {}

    def __iter__(self) -> Iterator[Destination]:
        return iter(self.by_name.values())

    def of(self, message: Message) -> Destination:
        return self.for_row(message.kind, message.name, message.options)

    def for_row(self, kind: int, name: str, options: Mapping[str, Any]) -> Destination:
        """A message's destination: the one its options name (an outbox backend of
        Django's Tasks framework names its own), else its route's."""
        named = options.get("destination")
        if named is not None:
            try:
                return self.by_name[named]
            except KeyError:
                raise ImproperlyConfigured(
                    f"An outbox message names the destination {named!r}, which "
                    "IDEMPOTENCY_OUTBOX_DESTINATIONS does not define."
                ) from None
        found = self._routes.get((kind, name))
        if found is None:
            found = self.by_name[route(kind, name)]
            self._routes[kind, name] = found
        return found

    def split(self, messages: Sequence[Message]) -> list[tuple[Destination, tuple[Message, ...]]]:
        """The messages by destination, each group in the order given."""
        if len(self.by_name) == 1:  # the common case: one destination, no lookups
            return [(next(iter(self)), tuple(messages))]
        groups: dict[str, list[Message]] = {}
        for message in messages:
            groups.setdefault(self.of(message).name, []).append(message)
        return [(self.by_name[name], tuple(group)) for name, group in groups.items()]

    def close(self) -> None:
        for destination in self:
            destination.close()
