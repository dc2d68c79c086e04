"""Request-time telemetry: the OpenTelemetry spans and instruments of a claim, a replay and a
close, as hooks on the unit of work; each a no-op without opentelemetry or a provider set.

Over 400 lines as one concern: the sync and async hooks and the instruments they record share
one set of names and attributes, which a split by signal would scatter."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from django_idempotency.engine.errors import (
    CONFLICT,
    ERROR,
    EXPIRED,
    FAILED,
    REPLAYED,
    REUSED,
    ROLLED_BACK_OUTCOME,
    STORE_UNAVAILABLE_OUTCOME,
    WON,
    IdempotencyError,
)
from django_idempotency.engine.work import view_name

try:
    from opentelemetry import metrics, trace
    from opentelemetry.trace import Status, StatusCode
except ImportError:  # pragma: no cover  (operators/test_telemetry.py proves it in a subprocess)
    ENABLED = False
else:
    ENABLED = True

    # What the API holds until the application sets a provider (None, or the proxies its
    # getters hand out), or a no-op one: spans and instruments that record nothing. The
    # meters' proxy is private to the API: recognised by its class's name (PROXY_METER_PROVIDER),
    # so that nothing private is imported or read when this module is.
    SILENT_PROVIDERS: tuple[type, ...] = (
        type(None),
        trace.ProxyTracerProvider,
        trace.NoOpTracerProvider,
        metrics.NoOpMeterProvider,
    )
PROXY_METER_PROVIDER = "_ProxyMeterProvider"

A = TypeVar("A")
R = TypeVar("R")
P = ParamSpec("P")

SCOPE = "django_idempotency"

# Spans.
CLAIM_SPAN = "idempotency.claim"
REPLAY_SPAN = "idempotency.replay"

# Instruments.
REQUESTS = "idempotency.requests"
REPLAYS = "idempotency.replays"
CONFLICTS = "idempotency.conflicts"
STORE_UNAVAILABLE = "idempotency.store_unavailable"
ROLLED_BACK = "idempotency.rolled_back"
CLAIM_DURATION = "idempotency.claim.duration"
WAIT_DURATION = "idempotency.wait.duration"
REDELIVERED = "idempotency.messages.redelivered"
ERRORS_LIMITED = "idempotency.stored_errors.limited"

# Attribute keys.
VIEW = "idempotency.view"  # the view, or the task of an exactly-once consumer
KIND = "idempotency.kind"  # "request" or "task"
OUTCOME = "idempotency.outcome"
STATUS_CODE = "http.response.status_code"
# OpenTelemetry's messaging attributes, on what counts messages (messaging/tracing.py's spans
# carry the same keys).
MESSAGING_OPERATION_NAME = "messaging.operation.name"
MESSAGING_DESTINATION = "messaging.destination.name"
ENCODING = "idempotency.encoding"  # how a replayed body went out: "zstd", "deflate", "identity"

DUPLICATES = frozenset((REPLAYED, CONFLICT, REUSED, EXPIRED))

# Seconds: a claim takes a round trip; a duplicate may wait up to IDEMPOTENCY_MAX_WAIT.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Instrumented(Protocol):
    """What the hooks read of a unit of work: who runs it, and whether a view or a task."""

    sender: Any
    kind: str


class Decided(Protocol):
    """A decision of ``open()``: its outcome label."""

    @property
    def outcome(self) -> str: ...


class Replaying(Protocol):
    """A replay: the stored status it answers with."""

    @property
    def status(self) -> int: ...


class _Headers(Protocol):
    def get(self, header: str, alternate: Any = ...) -> Any: ...


U = TypeVar("U", bound=Instrumented)
D = TypeVar("D", bound=Decided)
RP = TypeVar("RP", bound=Replaying)
RS = TypeVar("RS", bound=_Headers)


def outcome_of(error: BaseException) -> str:
    """The outcome an engine error stands for; ``error`` for anything else."""
    return error.outcome if isinstance(error, IdempotencyError) else ERROR


def _attributes(sender: Any, kind: str) -> dict[str, str]:
    if kind != "task":
        return {VIEW: view_name(sender), KIND: "request"}
    # A Celery task class: its name is what operators know it by.
    name = getattr(sender, "name", None)
    return {VIEW: name if isinstance(name, str) else view_name(sender), KIND: "task"}


@dataclass(frozen=True)
class _Instruments:
    requests: Any
    replays: Any
    conflicts: Any
    store_unavailable: Any
    rolled_back: Any
    claim_duration: Any
    wait_duration: Any
    redelivered: Any
    errors_limited: Any


@functools.cache
def _instruments() -> _Instruments:
    # Made from the global meter provider once; before the application sets one, the API's
    # proxy instruments forward to it as soon as it does.
    meter = metrics.get_meter(SCOPE)
    return _Instruments(
        requests=meter.create_counter(
            REQUESTS, "{request}", "Idempotent requests and deliveries, by outcome."
        ),
        replays=meter.create_counter(REPLAYS, "{request}", "Stored outcomes replayed."),
        conflicts=meter.create_counter(
            CONFLICTS, "{request}", "Duplicates refused with 409: the first was still running."
        ),
        store_unavailable=meter.create_counter(
            STORE_UNAVAILABLE, "{request}", "Refused with 503: the records' database was lost."
        ),
        rolled_back=meter.create_counter(
            ROLLED_BACK, "{request}", "Successes whose transaction was rolled back (500)."
        ),
        claim_duration=meter.create_histogram(
            CLAIM_DURATION,
            "s",
            "From the start of the claim to its decision (run, replay or refuse).",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        ),
        wait_duration=meter.create_histogram(
            WAIT_DURATION,
            "s",
            "How long a duplicate spent before its answer was known.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        ),
        redelivered=meter.create_counter(
            REDELIVERED,
            "{message}",
            "Redelivered messages that exactly-once consumers answered from the store.",
        ),
        errors_limited=meter.create_counter(
            ERRORS_LIMITED,
            "{principal}",
            "Principals past IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE, once a "
            "minute each: their further 4xx are answered but not stored.",
        ),
    )


@functools.cache
def _tracer() -> Any:
    # Like the instruments: a proxy until the application sets its tracer provider.
    return trace.get_tracer(SCOPE)


# Whether a provider was seen set: OpenTelemetry sets each at most once per process, so
# once heard, always heard.
_heard = False
_environment_read = False


def listening() -> bool:
    """Whether the application set a tracer or a meter provider. Until it does, the hooks
    skip their spans and measurements, which would record nothing and cost a claim tens
    of microseconds."""
    global _heard, _environment_read
    if _heard:
        return True
    if not _environment_read:
        # Once: the getters load a provider that OTEL_PYTHON_TRACER_PROVIDER (or
        # OTEL_PYTHON_METER_PROVIDER) names, and read os.environ on every call, which costs
        # microseconds; later checks read the globals they fill.
        _environment_read = True
        trace.get_tracer_provider()
        metrics.get_meter_provider()
    tracer = _global(trace, "_TRACER_PROVIDER", trace.get_tracer_provider)
    # The module the API keeps its meter provider in, as already imported by opentelemetry.
    internal = sys.modules.get("opentelemetry.metrics._internal")
    meter = _global(internal, "_METER_PROVIDER", metrics.get_meter_provider)
    _heard = not _silent(tracer) or not _silent(meter)
    return _heard


def _silent(provider: object) -> bool:
    return isinstance(provider, SILENT_PROVIDERS) or type(provider).__name__ == PROXY_METER_PROVIDER


def _global(module: ModuleType | None, name: str, getter: Callable[[], object]) -> object:
    # The API's global as it is, read at call time (the getter reads os.environ on every
    # call); an API that no longer keeps it there is asked its getter.
    try:
        found: object = getattr(module, name)
    except AttributeError:
        return getter()
    return found


def _count(instruments: _Instruments, attributes: dict[str, str], outcome: str) -> None:
    attributes = {**attributes, OUTCOME: outcome}
    instruments.requests.add(1, attributes)
    if outcome == REPLAYED:
        instruments.replays.add(1, attributes)
        if attributes[KIND] == "task":
            # The task is the message's destination (OpenTelemetry's messaging conventions).
            instruments.redelivered.add(
                1,
                {
                    VIEW: attributes[VIEW],
                    MESSAGING_OPERATION_NAME: "process",
                    MESSAGING_DESTINATION: attributes[VIEW],
                },
            )
    elif outcome == CONFLICT:
        instruments.conflicts.add(1, attributes)
    elif outcome == STORE_UNAVAILABLE_OUTCOME:
        instruments.store_unavailable.add(1, attributes)
    elif outcome == ROLLED_BACK_OUTCOME:
        instruments.rolled_back.add(1, attributes)


def errors_limited(sender: Any) -> None:
    """A principal went past the per-minute bound on stored 4xx (``engine/keeping.py``)."""
    if ENABLED and listening():
        _instruments().errors_limited.add(1, {VIEW: view_name(sender)})


# Hooks of the unit of work (decorators on its methods, so they stay one line each).


def traced_open(method: Callable[[U], D]) -> Callable[[U], D]:
    """``UnitOfWork.open``: the ``idempotency.claim`` span, the claim's duration (a waiting
    duplicate's wait included), and the outcome of a claim that does not run the work."""
    if not ENABLED:  # pragma: no cover
        return method

    @functools.wraps(method)
    def wrapper(unit: U) -> D:
        if not listening():
            return method(unit)
        decided: list[D] = []
        with _measured_claim(unit, decided):
            decided.append(method(unit))
        return decided[0]

    return wrapper


def traced_aopen(
    method: Callable[Concatenate[U, P], Coroutine[Any, Any, D]],
) -> Callable[Concatenate[U, P], Coroutine[Any, Any, D]]:
    """``UnitOfWork.aopen``: what ``traced_open`` measures, for the async wait."""
    if not ENABLED:  # pragma: no cover
        return method

    @functools.wraps(method)
    async def wrapper(unit: U, /, *args: P.args, **kwargs: P.kwargs) -> D:
        if not listening():
            return await method(unit, *args, **kwargs)
        decided: list[D] = []
        with _measured_claim(unit, decided):
            decided.append(await method(unit, *args, **kwargs))
        return decided[0]

    return wrapper


@contextmanager
def _measured_claim(unit: Instrumented, decided: list[D]) -> Iterator[None]:
    """The span and measurements of one claim; the block appends its decision to
    ``decided``."""
    instruments = _instruments()
    attributes = _attributes(unit.sender, unit.kind)
    tracer = _tracer()
    started = time.perf_counter()
    with tracer.start_as_current_span(
        CLAIM_SPAN, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield
        except BaseException as exc:
            outcome = outcome_of(exc)
            # The exception's type only: a database error's text can quote a key.
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        else:
            outcome = decided[0].outcome
        finally:
            elapsed = time.perf_counter() - started
            span.set_attribute(OUTCOME, outcome)
            measured = {**attributes, OUTCOME: outcome}
            instruments.claim_duration.record(elapsed, measured)
            if outcome in DUPLICATES:
                instruments.wait_duration.record(elapsed, measured)
            if outcome != WON:
                _count(instruments, attributes, outcome)


def _counted(
    success: str,
) -> Callable[[Callable[[U, A], R]], Callable[[U, A], R]]:
    """Count how a won claim's ``close`` or ``fail`` ended: ``success`` when it returned
    (or when ``fail`` re-raised the work's own exception), else what it raised."""

    def decorate(method: Callable[[U, A], R]) -> Callable[[U, A], R]:
        if not ENABLED:  # pragma: no cover
            return method

        @functools.wraps(method)
        def wrapper(unit: U, argument: A) -> R:
            if not listening():
                return method(unit, argument)
            ended = ERROR
            try:
                result = method(unit, argument)
                ended = success
                return result
            except BaseException as raised:
                ended = success if raised is argument else outcome_of(raised)
                raise
            finally:
                _count(_instruments(), _attributes(unit.sender, unit.kind), ended)

        return wrapper

    return decorate


# ``UnitOfWork.close``: won, rolled-back or store-unavailable.
counted_close = _counted(WON)
# ``UnitOfWork.fail``: the work raised, so everything was rolled back.
counted_fail = _counted(FAILED)


def refused(sender: Any, error: IdempotencyError) -> None:
    """A request refused before its claim (no key, a malformed key, no principal, or the
    store lost while the principal was loaded)."""
    if ENABLED and listening():
        _count(_instruments(), _attributes(sender, "view"), outcome_of(error))


def traced_replay(
    method: Callable[Concatenate[RP, P], RS],
) -> Callable[Concatenate[RP, P], RS]:
    """The rendering of a ``Replay`` (``http.request.replay_response``): the
    ``idempotency.replay`` span (decoding the stored body)."""
    if not ENABLED:  # pragma: no cover
        return method

    @functools.wraps(method)
    def wrapper(replay: RP, /, *args: P.args, **kwargs: P.kwargs) -> RS:
        if not listening():
            return method(replay, *args, **kwargs)
        tracer = _tracer()
        with tracer.start_as_current_span(
            REPLAY_SPAN,
            attributes={STATUS_CODE: replay.status},
            record_exception=False,
        ) as span:
            response = method(replay, *args, **kwargs)
            encoding = response.get("Content-Encoding") or "identity"
            span.set_attribute(ENCODING, encoding)
            return response

    return wrapper
