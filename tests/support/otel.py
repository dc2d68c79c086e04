"""The OpenTelemetry SDK for tests: set once per session, with in-memory exporters, and what
it exported since a test started. Import ``sdk_fixture`` and ``collect_fixture`` to use the
``sdk`` and ``collect`` fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableGauge,
)
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_idempotency import telemetry
from django_idempotency.engine import instrumentation

# One SDK for the whole session: OpenTelemetry lets a process set its providers once. Delta
# temporality, so that each collection holds only what happened since the previous one.
_DELTA = {
    Counter: AggregationTemporality.DELTA,
    Histogram: AggregationTemporality.DELTA,
    ObservableGauge: AggregationTemporality.DELTA,
}
SPANS = InMemorySpanExporter()
READER = InMemoryMetricReader(preferred_temporality=_DELTA)


class WhileCollecting(SimpleSpanProcessor):
    """Keeps spans only during tests of this module: other tests' spans are not kept."""

    recording = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.recording:
            super().on_end(span)


PROCESSOR = WhileCollecting(SPANS)


@pytest.fixture(scope="session", name="sdk")
def sdk_fixture() -> None:
    """Set the SDK as the global providers, once per session."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(PROCESSOR)
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))


class Collected:
    """What the SDK exported since the previous collection (which this one ends)."""

    def __init__(self) -> None:
        self.points: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        data = READER.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found = self.points.setdefault(metric.name, [])
                    for point in metric.data.data_points:
                        found.append((dict(point.attributes or {}), point))
        self.spans: list[ReadableSpan] = list(SPANS.get_finished_spans())
        SPANS.clear()

    def count(self, name: str, **attributes: str) -> int:
        """The sum of counter ``name`` over points whose attributes include ``attributes``."""
        return sum(
            point.value for found, point in self.points.get(name, []) if _matches(found, attributes)
        )

    def recorded(self, name: str, **attributes: str) -> list[Any]:
        """Histogram points of ``name`` whose attributes include ``attributes``."""
        return [p for found, p in self.points.get(name, []) if _matches(found, attributes)]

    def gauge(self, name: str, **attributes: str) -> list[float]:
        return [p.value for found, p in self.points.get(name, []) if _matches(found, attributes)]

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans if span.name == name]

    def every_value(self) -> list[str]:
        """Every attribute value, event attribute and status text exported, as text."""
        values = [
            str(value)
            for points in self.points.values()
            for attributes, _ in points
            for value in attributes.values()
        ]
        for span in self.spans:
            values += [str(value) for value in (span.attributes or {}).values()]
            values += [str(event.attributes) for event in span.events]
            values.append(span.name)
            values.append(str(span.status.description))
        return values


def _matches(found: dict[str, Any], wanted: dict[str, str]) -> bool:
    return all(found.get(_key(name)) == value for name, value in wanted.items())


def _key(name: str) -> str:
    return {
        "view": instrumentation.VIEW,
        "outcome": instrumentation.OUTCOME,
        "kind": instrumentation.KIND,
        "database": telemetry.DATABASE,
        "table": telemetry.TABLE,
    }.get(name, name)  # any other attribute by its own key ("messaging.operation.name")


@pytest.fixture(name="collect")
def collect_fixture(sdk: None) -> Iterator[Any]:
    """Call it to get what was exported since the test started (or the previous call)."""
    telemetry.forget_readings()
    READER.get_metrics_data()
    SPANS.clear()
    PROCESSOR.recording = True
    yield Collected
    PROCESSOR.recording = False
    SPANS.clear()
