"""Operator-time telemetry: gauges of partition headroom and outbox backlog read at scrape
time, and the relay's receivers, wired by ``connect()`` from ``AppConfig.ready()``."""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from django.conf import settings
from django.db import DatabaseError, connections, router

from django_idempotency import signals
from django_idempotency.engine.errors import (
    CONFLICT,
    ERROR,
    EXPIRED,
    FAILED,
    REFUSED,
    REPLAYED,
    REUSED,
    ROLLED_BACK_OUTCOME,
    STORE_UNAVAILABLE_OUTCOME,
    WON,
)
from django_idempotency.engine.instrumentation import (
    CLAIM_DURATION,
    CLAIM_SPAN,
    CONFLICTS,
    DUPLICATES,
    DURATION_BUCKETS,
    ENABLED,
    ENCODING,
    KIND,
    OUTCOME,
    REDELIVERED,
    REPLAY_SPAN,
    REPLAYS,
    REQUESTS,
    ROLLED_BACK,
    SCOPE,
    STATUS_CODE,
    STORE_UNAVAILABLE,
    VIEW,
    WAIT_DURATION,
    listening,
    outcome_of,
)
from django_idempotency.engine.work import view_name
from django_idempotency.partitions import catalog, tables
from django_idempotency.partitions.catalog import covered_until

if ENABLED:
    from opentelemetry import metrics
    from opentelemetry.metrics import Observation

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions

# This module's names, and the request-time ones it kept importable from here when they
# moved to the engine's instrumentation (and covered_until to the partitions' catalog).
__all__ = [
    "BACKLOG_COUNT_LIMIT",
    "CLAIM_DURATION",
    "CLAIM_SPAN",
    "CONFLICT",
    "CONFLICTS",
    "DATABASE",
    "DUPLICATES",
    "DURATION_BUCKETS",
    "ENABLED",
    "ENCODING",
    "ERROR",
    "EXPIRED",
    "FAILED",
    "GAUGE_CACHE_SECONDS",
    "KIND",
    "LAG_BUCKETS",
    "OUTBOX_BACKLOG",
    "OUTBOX_DEAD",
    "OUTBOX_MODEL",
    "OUTBOX_OLDEST_AGE",
    "OUTBOX_REDRIVEN",
    "OUTCOME",
    "PARTITION_HEADROOM",
    "RECORDS_MODEL",
    "REDELIVERED",
    "REFUSED",
    "RELAY_HEARTBEAT_AGE",
    "RELAY_LAG",
    "REPLAYED",
    "REPLAYS",
    "REPLAY_SPAN",
    "REQUESTS",
    "REUSED",
    "ROLLED_BACK",
    "ROLLED_BACK_OUTCOME",
    "SCOPE",
    "STATUS_CODE",
    "STORE_UNAVAILABLE",
    "STORE_UNAVAILABLE_OUTCOME",
    "TABLE",
    "VIEW",
    "WAIT_DURATION",
    "WON",
    "connect",
    "covered_until",
    "forget_readings",
    "listening",
    "message_time",
    "outcome_of",
    "view_name",
]

logger = logging.getLogger("django_idempotency.telemetry")
T = TypeVar("T")

# Instruments.
RELAY_LAG = "idempotency.relay.lag"
OUTBOX_REDRIVEN = "idempotency.outbox.redriven"
PARTITION_HEADROOM = "idempotency.partitions.headroom"
OUTBOX_BACKLOG = "idempotency.outbox.backlog"
OUTBOX_OLDEST_AGE = "idempotency.outbox.oldest_age"
OUTBOX_DEAD = "idempotency.outbox.dead"
RELAY_HEARTBEAT_AGE = "idempotency.relay.heartbeat_age"

# Attribute keys.
DATABASE = "idempotency.database"  # a database alias
TABLE = "idempotency.table"

# Seconds: from an enqueue to the relay marking the message published.
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

# Gauges read the catalog and the outbox at most this often per process and database.
GAUGE_CACHE_SECONDS = 60.0
# The backlog is counted up to this many rows ("at least"): a count stays cheap however
# far behind the relay is.
BACKLOG_COUNT_LIMIT = 100_000


@dataclass(frozen=True)
class _Instruments:
    relay_lag: Any
    redriven: Any


@functools.cache
def _instruments() -> _Instruments:
    # Like the request-time ones: proxies until the application sets its meter provider.
    meter = metrics.get_meter(SCOPE)
    return _Instruments(
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
            OUTBOX_DEAD,
            [_observe_dead],
            "{message}",
            f"Outbox dead letters, waiting to be requeued (counted up to {BACKLOG_COUNT_LIMIT}).",
        )
        meter.create_observable_gauge(
            OUTBOX_OLDEST_AGE,
            [_observe_oldest_age],
            "s",
            "Age of the oldest unpublished outbox message; 0 when there is none.",
        )
        meter.create_observable_gauge(
            RELAY_HEARTBEAT_AGE,
            [_observe_heartbeat_age],
            "s",
            "Seconds since the freshest relay heartbeat; absent when no relay has a row.",
        )


def message_time(message_id: str) -> float:
    """When an outbox message with a random (UUIDv7) id was enqueued (epoch seconds): its id
    says, to the millisecond, the same instant as its ``created_at``. An id derived from its
    request (version 8) says nothing of the kind."""
    return (uuid.UUID(message_id).int >> 80) / 1000


def _record_relay_lag(
    sender: Any, ids: list[str], using: str, enqueued: list[datetime] | None = None, **kwargs: Any
) -> None:
    histogram = _instruments().relay_lag
    now = time.time()
    # A message id derived from its request says no time: its row's created_at does.
    times = [at.timestamp() for at in enqueued] if enqueued else map(message_time, ids)
    for at in times:
        histogram.record(max(0.0, now - at), {DATABASE: using})


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
            days = (catalog.covered_until(partitions, now) - now).total_seconds() / 86400
            found.append((max(days, 0.0), {DATABASE: alias, TABLE: table.table}))
        return found

    if connections[alias].vendor != "postgresql":
        return []
    return _on(alias, read)


def _observe_headroom(options: CallbackOptions) -> Iterable[Observation]:
    def read() -> list[tuple[float, dict[str, str]]]:
        return [found for alias in _aliases(RECORDS_MODEL) for found in _headroom(alias)]

    return _observe(_cached(PARTITION_HEADROOM, read))


def _backlog() -> list[tuple[float, float, float, str]]:
    from django.utils import timezone

    from django_idempotency.messaging.outbox import leases

    found = []
    for alias in _aliases(OUTBOX_MODEL):

        def read(connection: Any, alias: str = alias) -> list[tuple[float, float, float, str]]:
            count = leases.backlog(alias, BACKLOG_COUNT_LIMIT)
            oldest = leases.oldest_pending(alias)
            age = 0.0 if oldest is None else (timezone.now() - oldest).total_seconds()
            dead = leases.dead_letters(alias, BACKLOG_COUNT_LIMIT)
            return [(float(count), max(age, 0.0), float(dead), alias)]

        found += _on(alias, read)
    return found


def _observe_backlog(options: CallbackOptions) -> Iterable[Observation]:
    readings = _cached(OUTBOX_BACKLOG, _backlog)
    return _observe([(count, {DATABASE: alias}) for count, _age, _dead, alias in readings])


def _observe_oldest_age(options: CallbackOptions) -> Iterable[Observation]:
    readings = _cached(OUTBOX_BACKLOG, _backlog)
    return _observe([(age, {DATABASE: alias}) for _count, age, _dead, alias in readings])


def _observe_dead(options: CallbackOptions) -> Iterable[Observation]:
    readings = _cached(OUTBOX_BACKLOG, _backlog)
    return _observe([(dead, {DATABASE: alias}) for _count, _age, dead, alias in readings])


def _heartbeat_ages() -> list[tuple[float, dict[str, str]]]:
    from django_idempotency.messaging.relay import heartbeats

    found = []
    for alias in _aliases(OUTBOX_MODEL):

        def read(connection: Any, alias: str = alias) -> list[tuple[float, dict[str, str]]]:
            freshest = heartbeats.freshest(alias)
            return [] if freshest is None else [(heartbeats.age(freshest), {DATABASE: alias})]

        found += _on(alias, read)
    return found


def _observe_heartbeat_age(options: CallbackOptions) -> Iterable[Observation]:
    # Not cached: one row read by its index, and an age must be now's, not a minute old.
    return _observe(_heartbeat_ages())
