"""Trace context carried by outbox messages (W3C ``traceparent``/``tracestate``, through
OpenTelemetry's propagator): taken from the enqueuing span, sent in each destination's headers
under the relay's publish span, and restored around an exactly-once consumer. Without
opentelemetry, or with no tracer provider set, nothing is stored and nothing is done."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from django_idempotency.engine.instrumentation import ENABLED, SCOPE, listening

if ENABLED:
    from opentelemetry import context, propagate, trace
    from opentelemetry.propagators.textmap import Getter
    from opentelemetry.trace import SpanKind, Status, StatusCode

# The key of the message's ``options`` document that holds its carrier.
TRACE_OPTION = "trace"
# OpenTelemetry's messaging conventions: a span is named "{operation} {destination}" ("send
# shop.post_ledger_entry", "process shop.post_ledger_entry"), the destination being the task
# name or the NATS subject (a template, not an id: low cardinality).
SEND = "send"
PROCESS = "process"
SYSTEM = "messaging.system"
OPERATION_NAME = "messaging.operation.name"
OPERATION = "messaging.operation.type"
DESTINATION = "messaging.destination.name"
MESSAGE_ID = "messaging.message.id"
OUTBOX_DESTINATION = "idempotency.destination"  # the relay's destination, by its setting's name
# messaging.system of a Celery broker, by its URL's scheme (the conventions' names where they
# have one; the scheme otherwise, "redis"); NATS and Django's Tasks framework name themselves.
BROKER_SYSTEMS = {"amqp": "rabbitmq", "amqps": "rabbitmq", "pyamqp": "rabbitmq", "sqs": "aws_sqs"}
NATS = "nats"
DJANGO_TASKS = "django_tasks"


def span_name(operation: str, destination: str) -> str:
    return f"{operation} {destination}"


def broker_system(url: str | None) -> str:
    """messaging.system for a Celery broker URL ("amqp://…" is "rabbitmq")."""
    scheme = (url or "amqp").partition("://")[0].partition("+")[0].lower()
    return BROKER_SYSTEMS.get(scheme, scheme or "celery")


def _tracing() -> bool:
    """Whether spans are recorded: opentelemetry installed, a provider set."""
    return ENABLED and listening()


def enqueue_context() -> dict[str, str] | None:
    """The current span's context as headers to store with a message; None when no span is
    recording (tracing off, or enqueued outside any traced request)."""
    if not _tracing():
        return None
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def stored_context(options: Mapping[str, Any]) -> dict[str, str] | None:
    carrier = options.get(TRACE_OPTION)
    return carrier if isinstance(carrier, dict) and carrier else None


# What a message without trace context is published with: no headers, no span.
_UNTRACED: contextlib.nullcontext[Mapping[str, str]] = contextlib.nullcontext(MappingProxyType({}))


def publish_span(
    message_id: str, name: str, options: Mapping[str, Any], destination: str, system: str
) -> contextlib.AbstractContextManager[Mapping[str, str]]:
    """Around the publish of one message: the headers to send it with (none when it has no
    trace context, at the cost of a dict lookup). With tracing on in the relay, the publish
    is a span, child of the enqueuing span, current while the block runs (so that a client's
    own instrumentation nests under it) and the one the headers carry; with it off, the
    stored headers go as they are, and the consumer is the enqueuing span's child."""
    carrier = stored_context(options)
    if carrier is None:
        return _UNTRACED
    if not _tracing():
        return contextlib.nullcontext(carrier)
    return _open_publish_span(carrier, message_id, name, destination, system)


@contextlib.contextmanager
def _open_publish_span(
    carrier: dict[str, str], message_id: str, name: str, destination: str, system: str
) -> Iterator[Mapping[str, str]]:
    attributes = {
        SYSTEM: system,
        OPERATION_NAME: SEND,
        OPERATION: SEND,
        DESTINATION: name,
        MESSAGE_ID: message_id,
        OUTBOX_DESTINATION: destination,
    }
    span = trace.get_tracer(SCOPE).start_span(
        span_name(SEND, name),
        context=propagate.extract(carrier),
        kind=SpanKind.PRODUCER,
        attributes=attributes,
    )
    current = trace.set_span_in_context(span)
    headers: dict[str, str] = {}
    propagate.inject(headers, context=current)
    token = context.attach(current)
    try:
        yield headers
    except BaseException as exc:
        _failed(span, exc)
        raise
    finally:
        context.detach(token)
        span.end()


def _failed(span: Any, exc: BaseException) -> None:
    # The exception's type only, as on the claim's span: an error's text can quote a key.
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


if ENABLED:
    if TYPE_CHECKING:
        _Getter = Getter[Any]
    else:  # subscripted in the types only, like every third-party base of the package
        _Getter = Getter

    class _RequestGetter(_Getter):
        """Reads a Celery task's request: a message header is an attribute of it (a worker),
        or an entry of its ``headers`` (an eager call)."""

        def get(self, carrier: Any, key: str) -> list[str] | None:
            value = getattr(carrier, key, None)
            if value is None:
                headers = getattr(carrier, "headers", None)
                value = headers.get(key) if isinstance(headers, dict) else None
            return [value] if isinstance(value, str) else None

        def keys(self, carrier: Any) -> list[str]:
            return []

    _REQUEST_GETTER = _RequestGetter()


_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def consume_span(
    request: Any, task_name: str, system: str
) -> contextlib.AbstractContextManager[object]:
    """Around an exactly-once Celery task's run: the ``process {task}`` span, child of
    the trace context its message carried, unless a span is current already (Celery's own
    OpenTelemetry instrumentation made one, from the same headers)."""
    if not _tracing() or trace.get_current_span().get_span_context().is_valid:
        return _NO_SPAN
    parent = propagate.extract(request, getter=_REQUEST_GETTER)
    return _open_consume_span(parent, str(request.id), task_name, system)


def consume_span_from_headers(
    headers: Mapping[str, str] | None, message_id: str, name: str, system: str
) -> contextlib.AbstractContextManager[object]:
    """As ``consuming``, for a consumer whose message carries its trace context as plain
    headers (a NATS message's, the Django Tasks runner's ``trace`` argument)."""
    if not headers or not _tracing() or trace.get_current_span().get_span_context().is_valid:
        return _NO_SPAN
    return _open_consume_span(propagate.extract(headers), message_id, name, system)


@contextlib.contextmanager
def _open_consume_span(parent: Any, message_id: str, name: str, system: str) -> Iterator[None]:
    attributes = {
        SYSTEM: system,
        OPERATION_NAME: PROCESS,
        OPERATION: PROCESS,
        DESTINATION: name,
        MESSAGE_ID: message_id,
    }
    with trace.get_tracer(SCOPE).start_as_current_span(
        span_name(PROCESS, name),
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield
        except BaseException as exc:
            _failed(span, exc)
            raise
