"""What operators watch, through OpenTelemetry (the ``otel`` extra): spans on the claim and
the replay, counters and histograms of outcomes, gauges of partition headroom and outbox
backlog. Without ``opentelemetry-api`` installed every hook here is a no-op; with it, until
the application sets a provider, the unit of work's hooks skip their spans and measurements.

Attributes are of low cardinality (the view, the outcome): never a key, a principal or a
body, which are bearer-like, personal, and would make one time series per request.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from django.conf import settings
from django.db import DatabaseError, connections, router
from django.http import HttpRequest

from django_idempotency import signals
from django_idempotency.engine.errors import (
    IdempotencyError,
    InProgress,
    KeyExpired,
    KeyReused,
    RolledBack,
    StoreUnavailable,
)

try:
    from opentelemetry import metrics, trace
    from opentelemetry.metrics import Observation
    from opentelemetry.trace import Status, StatusCode
except ImportError:  # pragma: no cover  (tests/test_telemetry.py proves it in a subprocess)
    ENABLED = False
else:
    ENABLED = True
    from opentelemetry.metrics import _internal as metrics_internal

    # What the API holds until the application sets a provider (None, or the proxies its
    # getters hand out), or a no-op one: spans and instruments that record nothing.
    SILENT_PROVIDERS: tuple[type, ...] = (
        type(None),
        trace.ProxyTracerProvider,
        trace.NoOpTracerProvider,
        metrics_internal._ProxyMeterProvider,
        metrics.NoOpMeterProvider,
    )

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions

    from django_idempotency.engine.unit import Decision, Replay, UnitOfWork

logger = logging.getLogger("django_idempotency.telemetry")
T = TypeVar("T")
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
RELAY_LAG = "idempotency.relay.lag"
OUTBOX_REDRIVEN = "idempotency.outbox.redriven"
PARTITION_HEADROOM = "idempotency.partitions.headroom"
OUTBOX_BACKLOG = "idempotency.outbox.backlog"
OUTBOX_OLDEST_AGE = "idempotency.outbox.oldest_age"

# Attribute keys.
VIEW = "idempotency.view"  # the view, or the task of an exactly-once consumer
KIND = "idempotency.kind"  # "request" or "task"
OUTCOME = "idempotency.outcome"
DATABASE = "idempotency.database"  # a database alias
TABLE = "idempotency.table"
STATUS_CODE = "http.response.status_code"
ENCODING = "idempotency.encoding"  # how a replayed body went out: "deflate" or "identity"

# Outcomes.
WON = "won"
REPLAYED = "replayed"
CONFLICT = "conflict"
REUSED = "reused"
EXPIRED = "expired"
REFUSED = "refused"
ROLLED_BACK_OUTCOME = "rolled-back"
STORE_UNAVAILABLE_OUTCOME = "store-unavailable"
FAILED = "failed"  # the work raised: the claim and the work's writes were rolled back
ERROR = "error"  # anything else raised by the engine (a misconfiguration)
DUPLICATES = frozenset((REPLAYED, CONFLICT, REUSED, EXPIRED))

# Seconds: a claim takes a round trip; a duplicate may wait up to IDEMPOTENCY_MAX_WAIT.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

# Gauges read the catalog and the outbox at most this often per process and database.
GAUGE_CACHE_SECONDS = 60.0
# The backlog is counted up to this many rows ("at least"): a count stays cheap however
# far behind the relay is.
BACKLOG_COUNT_LIMIT = 100_000


def outcome_of(error: BaseException) -> str:
    """The outcome an engine error stands for."""
    if isinstance(error, InProgress):
        return CONFLICT
    if isinstance(error, KeyReused):
        return REUSED
    if isinstance(error, KeyExpired):
        return EXPIRED
    if isinstance(error, RolledBack):
        return ROLLED_BACK_OUTCOME
    if isinstance(error, StoreUnavailable):
        return STORE_UNAVAILABLE_OUTCOME
    if isinstance(error, IdempotencyError):
        return REFUSED
    return ERROR


def view_name(sender: Any) -> str:
    """``module.qualname`` of a view (function or class) or a task class."""
    module = getattr(sender, "__module__", None) or ""
    name = getattr(sender, "__qualname__", None) or type(sender).__qualname__
    return f"{module}.{name}" if module else name


def _attributes(sender: Any, context: Any) -> dict[str, str]:
    if isinstance(context, HttpRequest):
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
    relay_lag: Any
    redriven: Any


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
        relay_lag=meter.create_histogram(
            RELAY_LAG,
            "s",
            "From a message's enqueue to the relay marking it published.",
            explicit_bucket_boundaries_advisory=LAG_BUCKETS,
        ),
        redriven=meter.create_counter(
            OUTBOX_REDRIVEN,
            "{message}",
            "Published outbox messages no exactly-once consumer had recorded, published again.",
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
    meter = _global(metrics_internal, "_METER_PROVIDER", metrics.get_meter_provider)
    _heard = not isinstance(tracer, SILENT_PROVIDERS) or not isinstance(meter, SILENT_PROVIDERS)
    return _heard


def _global(module: ModuleType, name: str, getter: Callable[[], object]) -> object:
    # The API's global as it is; an API that no longer keeps it there is asked its getter.
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
            instruments.redelivered.add(1, {VIEW: attributes[VIEW]})
    elif outcome == CONFLICT:
        instruments.conflicts.add(1, attributes)
    elif outcome == STORE_UNAVAILABLE_OUTCOME:
        instruments.store_unavailable.add(1, attributes)
    elif outcome == ROLLED_BACK_OUTCOME:
        instruments.rolled_back.add(1, attributes)


def _decided(decision: Decision) -> str:
    from django_idempotency.engine.unit import Refuse, Replay

    if isinstance(decision, Replay):
        return REPLAYED
    if isinstance(decision, Refuse):
        return outcome_of(decision.error)
    return WON


# Hooks of the unit of work (decorators on its methods, so they stay one line each).


def traced_open(method: Callable[[UnitOfWork], Decision]) -> Callable[[UnitOfWork], Decision]:
    """``UnitOfWork.open``: the ``idempotency.claim`` span, the claim's duration (a waiting
    duplicate's wait included), and the outcome of a claim that does not run the work."""
    if not ENABLED:  # pragma: no cover
        return method

    @functools.wraps(method)
    def wrapper(unit: UnitOfWork) -> Decision:
        if not listening():
            return method(unit)
        with _measured_claim(unit) as decided:
            decided.append(method(unit))
        return decided[0]

    return wrapper


def traced_aopen(
    method: Callable[Concatenate[UnitOfWork, P], Coroutine[Any, Any, Decision]],
) -> Callable[Concatenate[UnitOfWork, P], Coroutine[Any, Any, Decision]]:
    """``UnitOfWork.aopen``: what ``traced_open`` measures, for the async wait."""
    if not ENABLED:  # pragma: no cover
        return method

    @functools.wraps(method)
    async def wrapper(unit: UnitOfWork, /, *args: P.args, **kwargs: P.kwargs) -> Decision:
        if not listening():
            return await method(unit, *args, **kwargs)
        with _measured_claim(unit) as decided:
            decided.append(await method(unit, *args, **kwargs))
        return decided[0]

    return wrapper


@contextmanager
def _measured_claim(unit: UnitOfWork) -> Iterator[list[Decision]]:
    """The span and measurements of one claim; the block appends its decision."""
    instruments = _instruments()
    attributes = _attributes(unit.sender, unit.context)
    tracer = _tracer()
    started = time.perf_counter()
    decided: list[Decision] = []
    with tracer.start_as_current_span(
        CLAIM_SPAN, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield decided
        except BaseException as exc:
            outcome = outcome_of(exc)
            # The exception's type only: a database error's text can quote a key.
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        else:
            outcome = _decided(decided[0])
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
) -> Callable[[Callable[[UnitOfWork, A], R]], Callable[[UnitOfWork, A], R]]:
    """Count how a won claim's ``close`` or ``fail`` ended: ``success`` when it returned
    (or when ``fail`` re-raised the work's own exception), else what it raised."""

    def decorate(method: Callable[[UnitOfWork, A], R]) -> Callable[[UnitOfWork, A], R]:
        if not ENABLED:  # pragma: no cover
            return method

        @functools.wraps(method)
        def wrapper(unit: UnitOfWork, argument: A) -> R:
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
                _count(_instruments(), _attributes(unit.sender, unit.context), ended)

        return wrapper

    return decorate


# ``UnitOfWork.close``: won, rolled-back or store-unavailable.
counted_close = _counted(WON)
# ``UnitOfWork.fail``: the work raised, so everything was rolled back.
counted_fail = _counted(FAILED)


def refused(sender: Any, context: Any, error: IdempotencyError) -> None:
    """A request refused before its claim (no key, a malformed key, no principal, or the
    store lost while the principal was loaded)."""
    if ENABLED and listening():
        _count(_instruments(), _attributes(sender, context), outcome_of(error))


def traced_replay(method: Callable[[Replay], Any]) -> Callable[[Replay], Any]:
    """``Replay.response``: the ``idempotency.replay`` span (decoding the stored body)."""
    if not ENABLED:  # pragma: no cover
        return method

    @functools.wraps(method)
    def wrapper(replay: Replay) -> Any:
        if not listening():
            return method(replay)
        tracer = _tracer()
        with tracer.start_as_current_span(
            REPLAY_SPAN,
            attributes={STATUS_CODE: replay.record.response_code},
            record_exception=False,
        ) as span:
            response = method(replay)
            encoding = "deflate" if response.get("Content-Encoding") == "deflate" else "identity"
            span.set_attribute(ENCODING, encoding)
            return response

    return wrapper


# Receivers and gauges, set up from AppConfig.ready().

_connecting = threading.Lock()
_gauges_made = False


def connect() -> None:
    """Connect the receivers and register the gauges; called from ``AppConfig.ready()``.
    Does nothing without opentelemetry, and nothing the second time."""
    global _gauges_made
    if not ENABLED:  # pragma: no cover
        return
    signals.outbox_published.connect(
        _record_relay_lag, dispatch_uid="django_idempotency.telemetry.relay_lag"
    )
    signals.outbox_redriven.connect(
        _count_redriven, dispatch_uid="django_idempotency.telemetry.redriven"
    )
    with _connecting:
        if _gauges_made:
            return
        _gauges_made = True
        meter = metrics.get_meter(SCOPE)
        meter.create_observable_gauge(
            PARTITION_HEADROOM,
            [_observe_headroom],
            "d",
            "Days from now until the first moment no partition holds (per table and database).",
        )
        meter.create_observable_gauge(
            OUTBOX_BACKLOG,
            [_observe_backlog],
            "{message}",
            f"Unpublished outbox messages (counted up to {BACKLOG_COUNT_LIMIT}).",
        )
        meter.create_observable_gauge(
            OUTBOX_OLDEST_AGE,
            [_observe_oldest_age],
            "s",
            "Age of the oldest unpublished outbox message; 0 when there is none.",
        )


def message_time(message_id: str) -> float:
    """When an outbox message was enqueued (epoch seconds): its UUIDv7 id says, to the
    millisecond, the same instant as its ``created_at``."""
    return (uuid.UUID(message_id).int >> 80) / 1000


def _record_relay_lag(sender: Any, ids: list[str], using: str, **kwargs: Any) -> None:
    histogram = _instruments().relay_lag
    now = time.time()
    for message_id in ids:
        histogram.record(max(0.0, now - message_time(message_id)), {DATABASE: using})


def _count_redriven(sender: Any, ids: list[str], using: str, **kwargs: Any) -> None:
    _instruments().redriven.add(len(ids), {DATABASE: using})


# Gauges: a cheap read per database, at most once a GAUGE_CACHE_SECONDS per process.

RECORDS_MODEL = "django_idempotency.IdempotencyRecord"
OUTBOX_MODEL = "django_idempotency.OutboxMessage"


@dataclass(frozen=True)
class _Reading:
    at: float
    observations: list[Any]


_readings: dict[str, _Reading] = {}
_readings_lock = threading.Lock()


def forget_readings() -> None:
    """Drop the cached gauge readings (tests)."""
    with _readings_lock:
        _readings.clear()


def _cached(name: str, read: Callable[[], list[T]]) -> list[T]:
    now = time.monotonic()
    with _readings_lock:
        found = _readings.get(name)
        if found is not None and now - found.at < GAUGE_CACHE_SECONDS:
            return found.observations
    observations = read()
    with _readings_lock:
        _readings[name] = _Reading(now, observations)
    return observations


def _aliases(model_label: str) -> Iterator[str]:
    from django.apps import apps

    model = apps.get_model(model_label)
    for alias in settings.DATABASES:
        if router.allow_migrate_model(alias, model):
            yield alias


def _observe(readings: list[tuple[float, dict[str, str]]]) -> Iterable[Observation]:
    return [Observation(value, attributes) for value, attributes in readings]


def _on(alias: str, read: Callable[[Any], list[T]]) -> list[T]:
    # The reader's thread closes the connection it opened (nothing else would), and leaves
    # one it found open as it was. A database that cannot be read gives no value: an alert
    # on the gauge being absent catches it.
    connection = connections[alias]
    opened = connection.connection is None
    try:
        return read(connection)
    except DatabaseError as exc:
        logger.warning("Idempotency gauges could not read database %r: %s", alias, exc)
        return []
    finally:
        if opened and not connection.in_atomic_block:
            connection.close()


def _headroom(alias: str) -> list[tuple[float, dict[str, str]]]:
    from django_idempotency.partitions import catalog, tables

    def read(connection: Any) -> list[tuple[float, dict[str, str]]]:
        found = []
        now = catalog.database_now(connection)
        for table in tables.registered():
            model = table.model_class()
            if model is not None and not router.allow_migrate_model(alias, model):
                continue
            if catalog.table_kind(connection, table) != "partitioned":
                continue
            partitions = catalog.list_partitions(connection, table)
            days = (covered_until(partitions, now) - now).total_seconds() / 86400
            found.append((max(days, 0.0), {DATABASE: alias, TABLE: table.table}))
        return found

    if connections[alias].vendor != "postgresql":
        return []
    return _on(alias, read)


def covered_until(partitions: Iterable[Any], now: datetime) -> datetime:
    """The first moment from ``now`` on that no live partition holds (``now`` itself when
    none holds it). A DEFAULT partition is not counted: we never create one."""
    spans = sorted(
        (p.lower or datetime.min.replace(tzinfo=UTC), p.upper)
        for p in partitions
        if p.live and not p.default and p.upper is not None
    )
    reached = now
    for lower, upper in spans:
        if lower > reached:
            break
        reached = max(reached, upper)
    return reached


def _observe_headroom(options: CallbackOptions) -> Iterable[Observation]:
    def read() -> list[tuple[float, dict[str, str]]]:
        return [found for alias in _aliases(RECORDS_MODEL) for found in _headroom(alias)]

    return _observe(_cached(PARTITION_HEADROOM, read))


def _backlog() -> list[tuple[float, float, str]]:
    from django.db.models import Min
    from django.utils import timezone

    from django_idempotency.models import OutboxMessage

    found = []
    for alias in _aliases(OUTBOX_MODEL):

        def read(connection: Any, alias: str = alias) -> list[tuple[float, float, str]]:
            pending = OutboxMessage.objects.using(alias).filter(published_at__isnull=True)
            count = pending.values("pk")[:BACKLOG_COUNT_LIMIT].count()
            oldest = pending.aggregate(oldest=Min("created_at"))["oldest"]
            age = 0.0 if oldest is None else (timezone.now() - oldest).total_seconds()
            return [(float(count), max(age, 0.0), alias)]

        found += _on(alias, read)
    return found


def _observe_backlog(options: CallbackOptions) -> Iterable[Observation]:
    readings = _cached(OUTBOX_BACKLOG, _backlog)
    return _observe([(count, {DATABASE: alias}) for count, _age, alias in readings])


def _observe_oldest_age(options: CallbackOptions) -> Iterable[Observation]:
    readings = _cached(OUTBOX_BACKLOG, _backlog)
    return _observe([(age, {DATABASE: alias}) for _count, age, alias in readings])
