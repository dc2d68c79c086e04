"""OpenTelemetry: spans, counters, histograms and gauges through the SDK's in-memory exporters,
for requests sent through Django's test client; and the package without opentelemetry."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

pytest.importorskip("opentelemetry.sdk")
from opentelemetry import metrics, trace
from opentelemetry.metrics._internal import _ProxyMeterProvider
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
from opentelemetry.trace import StatusCode

from django_idempotency import signals, telemetry
from django_idempotency.decorators import idempotent
from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions import catalog
from django_idempotency.partitions.tables import RECORDS
from tests.claims import held_claim, unreachable_store
from tests.client import replayed, send
from tests.factories import ScriptFactory, UserFactory, new_key
from tests.views import Boom

pytestmark = pytest.mark.urls("tests.urls")

SCRIPTED = "tests.views.ScriptedView"
PLAIN = "tests.views._plain"

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


@pytest.fixture(scope="session")
def sdk() -> None:
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
        "view": telemetry.VIEW,
        "outcome": telemetry.OUTCOME,
        "kind": telemetry.KIND,
        "database": telemetry.DATABASE,
        "table": telemetry.TABLE,
    }[name]


@pytest.fixture
def collect(sdk: None) -> Iterator[Any]:
    """Call it to get what was exported since the test started (or the previous call)."""
    telemetry.forget_readings()
    READER.get_metrics_data()
    SPANS.clear()
    PROCESSOR.recording = True
    yield Collected
    PROCESSOR.recording = False
    SPANS.clear()


@pytest.mark.django_db
def test_a_fresh_key_is_a_won_claim_span_and_a_won_request(client, collect: Any) -> None:
    response = send(client, "POST", "/drf/", ScriptFactory(), key=new_key())
    assert response.status_code == 201
    got = collect()
    (claim,) = got.named(telemetry.CLAIM_SPAN)
    assert claim.attributes == {
        telemetry.VIEW: SCRIPTED,
        telemetry.KIND: "request",
        telemetry.OUTCOME: "won",
    }
    assert claim.status.status_code is StatusCode.UNSET
    assert got.named(telemetry.REPLAY_SPAN) == []
    assert got.count(telemetry.REQUESTS, view=SCRIPTED, outcome="won") == 1
    assert got.count(telemetry.REQUESTS) == 1
    (duration,) = got.recorded(telemetry.CLAIM_DURATION, view=SCRIPTED, outcome="won")
    assert duration.count == 1 and 0 < duration.sum < 10
    # Only duplicates wait.
    assert got.recorded(telemetry.WAIT_DURATION) == []


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "view"), [("/drf/", SCRIPTED), ("/plain/", PLAIN)])
def test_a_replay_is_a_replayed_claim_a_replay_span_and_a_replay_count(
    client, collect: Any, path: str, view: str
) -> None:
    key, script = new_key(), ScriptFactory(status=202)
    send(client, "POST", path, script, key=key)
    collect()  # the first request's, set aside
    again = send(client, "POST", path, script, key=key)
    assert replayed(again) and again.status_code == 202
    got = collect()
    (claim,) = got.named(telemetry.CLAIM_SPAN)
    assert claim.attributes is not None
    assert claim.attributes[telemetry.OUTCOME] == "replayed"
    assert claim.attributes[telemetry.VIEW] == view
    (replay,) = got.named(telemetry.REPLAY_SPAN)
    assert replay.attributes == {telemetry.STATUS_CODE: 202, telemetry.ENCODING: "identity"}
    assert got.count(telemetry.REPLAYS, view=view, kind="request") == 1
    assert got.count(telemetry.REQUESTS, view=view, outcome="replayed") == 1
    assert got.count(telemetry.REQUESTS) == 1
    (waited,) = got.recorded(telemetry.WAIT_DURATION, view=view, outcome="replayed")
    assert waited.count == 1


@pytest.mark.django_db(transaction=True)
def test_a_409_conflict_is_counted_with_its_wait(
    client, collect: Any, waiting_on_main_thread: None
) -> None:
    key = new_key()
    with held_claim("anonymous", key):
        started = time.monotonic()
        response = send(
            client, "POST", "/drf/", ScriptFactory(), key=key, headers={"Prefer": "wait=1"}
        )
        elapsed = time.monotonic() - started
    assert response.status_code == 409
    got = collect()
    (claim,) = got.named(telemetry.CLAIM_SPAN)
    assert claim.attributes is not None and claim.attributes[telemetry.OUTCOME] == "conflict"
    assert got.count(telemetry.CONFLICTS, view=SCRIPTED) == 1
    assert got.count(telemetry.REQUESTS, outcome="conflict") == 1
    (waited,) = got.recorded(telemetry.WAIT_DURATION, outcome="conflict")
    # The duplicate waited the second it asked for, and no longer than it was kept.
    assert 0.9 <= waited.sum <= elapsed


@pytest.mark.django_db
def test_a_422_reuse_is_counted_and_not_replayed(client, collect: Any) -> None:
    key = new_key()
    send(client, "POST", "/drf/", ScriptFactory(), key=key)
    response = send(client, "POST", "/drf/", ScriptFactory(), key=key)
    assert response.status_code == 422
    got = collect()
    outcomes = [span.attributes[telemetry.OUTCOME] for span in got.named(telemetry.CLAIM_SPAN)]
    assert outcomes == ["won", "reused"]
    assert got.count(telemetry.REQUESTS, view=SCRIPTED, outcome="reused") == 1
    assert got.count(telemetry.REPLAYS) == 0
    assert got.named(telemetry.REPLAY_SPAN) == []


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "view"), [("/drf/", SCRIPTED), ("/plain/", PLAIN)])
def test_a_503_store_unavailable_is_counted_and_its_span_is_an_error(
    client, settings, collect: Any, path: str, view: str
) -> None:
    with unreachable_store(settings):
        response = send(client, "POST", path, ScriptFactory(), key=new_key())
    assert response.status_code == 503
    got = collect()
    (claim,) = got.named(telemetry.CLAIM_SPAN)
    assert claim.attributes is not None
    assert claim.attributes[telemetry.OUTCOME] == "store-unavailable"
    assert claim.status.status_code is StatusCode.ERROR
    assert claim.status.description == "StoreUnavailable"
    assert got.count(telemetry.STORE_UNAVAILABLE, view=view) == 1
    assert got.count(telemetry.REQUESTS, view=view, outcome="store-unavailable") == 1


@pytest.mark.django_db
def test_a_410_expired_key_is_counted(client, settings, collect: Any) -> None:
    settings.IDEMPOTENCY_EXPIRED_WINDOW = timedelta(hours=1)
    key, script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", script, key=key)
    # Before its creation: the claim compares with the transaction's clock, which stands still.
    record = IdempotencyRecord.objects.get(key=key)
    record.expires_at = record.created_at - timedelta(minutes=1)
    record.save(update_fields=["expires_at"])
    assert send(client, "POST", "/drf/", script, key=key).status_code == 410
    got = collect()
    assert got.count(telemetry.REQUESTS, view=SCRIPTED, outcome="expired") == 1
    assert len(got.recorded(telemetry.WAIT_DURATION, outcome="expired")) == 1


@pytest.mark.django_db
def test_an_engine_error_at_the_close_is_counted_as_error(client, settings, collect: Any) -> None:
    settings.IDEMPOTENCY_MAX_RESPONSE_BYTES = 10
    with pytest.raises(ImproperlyConfigured):
        send(client, "POST", "/plain/", ScriptFactory(), key=new_key())
    got = collect()
    assert got.count(telemetry.REQUESTS, view=PLAIN, outcome="error") == 1


@pytest.mark.django_db
def test_a_request_refused_before_its_claim_is_counted_without_a_claim_span(
    client, collect: Any
) -> None:
    response = send(client, "POST", "/drf/required/", ScriptFactory())
    assert response.status_code == 400
    got = collect()
    assert got.named(telemetry.CLAIM_SPAN) == []
    assert got.count(telemetry.REQUESTS, view=SCRIPTED, outcome="refused") == 1


@pytest.mark.django_db
def test_a_rolled_back_success_is_counted_as_rolled_back(client, collect: Any) -> None:
    response = send(client, "POST", "/drf/", ScriptFactory(rollback_only=True), key=new_key())
    assert response.status_code == 500
    got = collect()
    assert got.count(telemetry.ROLLED_BACK, view=SCRIPTED) == 1
    assert got.count(telemetry.REQUESTS, view=SCRIPTED, outcome="rolled-back") == 1
    assert got.count(telemetry.REQUESTS, outcome="won") == 0


@pytest.mark.django_db
def test_a_view_that_raises_is_counted_as_failed(client, collect: Any) -> None:
    with pytest.raises(Boom):
        send(client, "POST", "/plain/", ScriptFactory(fail="raise"), key=new_key())
    got = collect()
    assert got.count(telemetry.REQUESTS, view=PLAIN, outcome="failed") == 1


@pytest.mark.django_db
def test_requests_without_a_key_leave_no_telemetry(client, collect: Any) -> None:
    assert send(client, "POST", "/drf/", ScriptFactory()).status_code == 201
    got = collect()
    assert got.spans == [] and got.count(telemetry.REQUESTS) == 0


@pytest.mark.django_db(transaction=True)
def test_no_exported_value_carries_a_key_or_a_principal(client, settings, collect: Any) -> None:
    user = UserFactory()
    client.force_login(user)
    principal = f"user:{user.pk}"
    keys = [new_key() for _ in range(4)]
    first = ScriptFactory()
    send(client, "POST", "/drf/", first, key=keys[0])
    send(client, "POST", "/drf/", first, key=keys[0])  # replay
    send(client, "POST", "/drf/", ScriptFactory(), key=keys[0])  # 422
    with held_claim(principal, keys[1]):
        send(client, "POST", "/drf/no-wait/", ScriptFactory(), key=keys[1])  # 409
    send(client, "POST", "/drf/", ScriptFactory(rollback_only=True), key=keys[2])
    with unreachable_store(settings):
        send(client, "POST", "/drf/", ScriptFactory(), key=keys[3])
    got = collect()
    outcomes = {span.attributes[telemetry.OUTCOME] for span in got.named(telemetry.CLAIM_SPAN)}
    assert outcomes == {"won", "replayed", "reused", "conflict", "store-unavailable"}
    values = got.every_value()
    assert values
    for value in values:
        assert principal not in value
        assert user.username not in value
        for key in keys:
            assert key not in value and key[:8] not in value


@pytest.mark.django_db
def test_partition_headroom_is_the_time_until_the_first_day_without_a_partition(
    collect: Any,
) -> None:
    now = catalog.database_now(connection)
    missing = now.date() + timedelta(days=3)
    with connection.cursor() as cursor:
        # Undone with the test's transaction.
        cursor.execute(
            f'ALTER TABLE {RECORDS.table} DETACH PARTITION "{RECORDS.partition_name(missing)}"'
        )
    telemetry.forget_readings()  # the fixture's collection read the partitions before
    got = collect()
    (days,) = got.gauge(telemetry.PARTITION_HEADROOM, database="default", table=RECORDS.table)
    start_of_missing = datetime(missing.year, missing.month, missing.day, tzinfo=UTC)
    expected = (start_of_missing - now).total_seconds() / 86400
    assert abs(days - expected) < 0.01
    assert 2 < days <= 3
    (outbox_days,) = got.gauge(telemetry.PARTITION_HEADROOM, table="django_idempotency_outbox")
    assert outbox_days > 5


@pytest.mark.django_db
def test_a_database_that_cannot_be_read_gives_no_gauge_and_the_others_still_do(
    settings, collect: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with unreachable_store(settings) as alias:
        monkeypatch.setattr(telemetry, "_aliases", lambda model: iter(["default", alias]))
        telemetry.forget_readings()
        got = collect()
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database=alias) == []
    assert got.gauge(telemetry.PARTITION_HEADROOM, database=alias) == []
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [0]
    assert len(got.gauge(telemetry.PARTITION_HEADROOM, database="default")) == 2
    assert f"could not read database '{alias}'" in caplog.text


@pytest.mark.django_db
def test_connecting_twice_registers_each_gauge_and_receiver_once(collect: Any) -> None:
    telemetry.connect()
    telemetry.connect()
    got = collect()
    assert len(got.gauge(telemetry.OUTBOX_BACKLOG, database="default")) == 1
    for signal in (signals.outbox_published, signals.outbox_redriven):
        receivers = [r for r in signal.receivers if "telemetry" in str(r[0])]
        assert len(receivers) == 1


def test_covered_until_stops_at_a_gap_and_at_now_when_nothing_holds_now() -> None:
    day = timedelta(days=1)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    parts = [
        catalog.Partition(f"p{n}", base + n * day, base + (n + 1) * day, None) for n in (0, 1, 2, 4)
    ]
    assert telemetry.covered_until(parts, base + day / 2) == base + 3 * day
    assert telemetry.covered_until(parts, base + 3 * day + day / 2) == base + 3 * day + day / 2
    detached = [catalog.Partition("p1", base, base + day, None, attached=False)]
    assert telemetry.covered_until(detached, base) == base


@pytest.mark.django_db
def test_outbox_backlog_and_oldest_age_are_gauges_cached_for_a_minute(collect: Any) -> None:
    got = collect()
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [0]
    assert got.gauge(telemetry.OUTBOX_OLDEST_AGE, database="default") == [0]
    telemetry.forget_readings()
    with transaction.atomic():
        enqueue_task("tests.telemetry.noop", (1,))
        enqueue_task("tests.telemetry.noop", (2,))
    time.sleep(0.2)
    got = collect()
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [2]
    (age,) = got.gauge(telemetry.OUTBOX_OLDEST_AGE, database="default")
    assert 0.2 <= age < 60
    # Read again within the minute: the same reading, no query.
    with transaction.atomic():
        enqueue_task("tests.telemetry.noop", (3,))
    again = collect()
    assert again.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [2]


@pytest.mark.django_db(transaction=True)
def test_relay_lag_is_recorded_per_published_message(collect: Any) -> None:
    pytest.importorskip("celery")
    from celery import Celery

    from django_idempotency.messaging.relay import Relay

    with transaction.atomic():
        for n in range(3):
            enqueue_task("tests.telemetry.noop", (n,))
    time.sleep(0.1)
    app = Celery(f"telemetry-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    assert Relay(app=app).drain() == 3
    got = collect()
    (lag,) = got.recorded(telemetry.RELAY_LAG, database="default")
    assert lag.count == 3
    assert 0.3 <= lag.sum < 60


def test_messages_the_redrive_published_again_are_counted(collect: Any) -> None:
    signals.outbox_redriven.send_robust(None, ids=["a", "b"], using="default")
    signals.outbox_redriven.send_robust(None, ids=["c"], using="other")
    got = collect()
    assert got.count(telemetry.OUTBOX_REDRIVEN, database="default") == 2
    assert got.count(telemetry.OUTBOX_REDRIVEN, database="other") == 1


def test_a_message_id_tells_when_it_was_enqueued() -> None:
    from django_idempotency.messaging.outbox import new_message_id

    message_id, created_at = new_message_id()
    assert telemetry.message_time(str(message_id)) == created_at.timestamp()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("tracer_provider", "meter_provider", "globals_kept"),
    [
        (None, None, True),  # the API before any setup
        (trace.NoOpTracerProvider(), metrics.NoOpMeterProvider(), True),
        # An API that keeps no globals where we read them: asked through its getters.
        (trace.ProxyTracerProvider(), _ProxyMeterProvider(), False),
    ],
)
def test_without_a_provider_set_the_hooks_record_nothing_and_keys_still_work(
    client,
    collect: Any,
    monkeypatch: pytest.MonkeyPatch,
    tracer_provider: Any,
    meter_provider: Any,
    globals_kept: bool,
) -> None:
    # As in a process whose application set no provider (this session's are set for good).
    monkeypatch.setattr(telemetry, "_heard", False)
    monkeypatch.setattr(telemetry, "_environment_read", False)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: tracer_provider)
    monkeypatch.setattr(metrics, "get_meter_provider", lambda: meter_provider)
    if globals_kept:
        monkeypatch.setattr(trace, "_TRACER_PROVIDER", tracer_provider)
        monkeypatch.setattr(telemetry.metrics_internal, "_METER_PROVIDER", meter_provider)
    else:
        monkeypatch.delattr(trace, "_TRACER_PROVIDER")
        monkeypatch.delattr(telemetry.metrics_internal, "_METER_PROVIDER")
    key, script = new_key(), ScriptFactory()
    assert send(client, "POST", "/drf/", script, key=key).status_code == 201
    assert replayed(send(client, "POST", "/drf/", script, key=key))
    assert send(client, "POST", "/drf/required/", ScriptFactory()).status_code == 400
    with pytest.raises(Boom):
        send(client, "POST", "/plain/", ScriptFactory(fail="raise"), key=new_key())
    assert not telemetry.listening()
    got = collect()
    assert got.spans == [] and got.count(telemetry.REQUESTS) == 0
    assert got.recorded(telemetry.CLAIM_DURATION) == []
    monkeypatch.undo()
    # The SDK's providers are set: heard from now on.
    assert telemetry.listening()


def test_a_provider_named_by_the_environment_is_loaded_and_heard(
    sdk: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = trace.get_tracer_provider()
    monkeypatch.setattr(telemetry, "_heard", False)
    monkeypatch.setattr(telemetry, "_environment_read", False)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(telemetry.metrics_internal, "_METER_PROVIDER", None)
    loads: list[str] = []

    def from_environment() -> Any:
        # What the API's getter does when OTEL_PYTHON_TRACER_PROVIDER names a provider.
        loads.append("tracer")
        trace._TRACER_PROVIDER = provider
        return provider

    monkeypatch.setattr(trace, "get_tracer_provider", from_environment)
    assert telemetry.listening() and telemetry.listening()
    assert loads == ["tracer"]


@pytest.mark.django_db(transaction=True)
def test_a_redelivered_message_answered_from_the_store_is_counted(collect: Any) -> None:
    pytest.importorskip("celery")
    from tests.test_consumers import GATE, deliver, note

    GATE.set()  # note's body waits for it
    message_id = str(uuid.uuid4())
    assert deliver(note, message_id, 1).state == "SUCCESS"
    assert deliver(note, message_id, 1).state == "SUCCESS"
    got = collect()
    view = "tests.consumers.note"  # the task's name
    assert got.count(telemetry.REDELIVERED, view=view) == 1
    assert got.count(telemetry.REQUESTS, view=view, kind="task", outcome="won") == 1
    assert got.count(telemetry.REPLAYS, view=view, kind="task") == 1
    spans = got.named(telemetry.CLAIM_SPAN)
    assert [span.attributes[telemetry.OUTCOME] for span in spans] == ["won", "replayed"]


@csrf_exempt
@idempotent
async def async_charge(request: HttpRequest) -> JsonResponse:
    group = await Group.objects.acreate(name=f"async:{uuid.uuid4().hex}")
    return JsonResponse({"group": group.pk}, status=201)


urlpatterns = [path("async/", async_charge)]
ASYNC_VIEW = "tests.test_telemetry.async_charge"


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls("tests.test_telemetry")
def test_an_async_views_claim_is_a_child_of_the_request_span(client, collect: Any) -> None:
    key = new_key()
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /async/") as server:
        assert send(client, "POST", "/async/", {}, key=key).status_code == 201
    with tracer.start_as_current_span("POST /async/ again") as retry:
        again = send(client, "POST", "/async/", {}, key=key)
    assert replayed(again)
    got = collect()
    claims = got.named(telemetry.CLAIM_SPAN)
    assert [span.attributes[telemetry.OUTCOME] for span in claims] == ["won", "replayed"]
    assert {span.attributes[telemetry.VIEW] for span in claims} == {ASYNC_VIEW}
    first = claims[0]
    assert first.parent is not None
    assert first.parent.span_id == server.get_span_context().span_id
    (replay,) = got.named(telemetry.REPLAY_SPAN)
    assert claims[1].parent is not None and replay.parent is not None
    assert claims[1].parent.span_id == replay.parent.span_id == retry.get_span_context().span_id
    assert got.count(telemetry.REQUESTS, view=ASYNC_VIEW, outcome="won") == 1
    assert got.count(telemetry.REPLAYS, view=ASYNC_VIEW) == 1


PROBE = """
import sys
sys.modules["opentelemetry"] = None  # any "import opentelemetry..." now raises ImportError
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes",
                    "django.contrib.sessions", "rest_framework", "rest_framework.authtoken",
                    "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True, ROOT_URLCONF="tests.urls", ALLOWED_HOSTS=["testserver"],
)
import django
django.setup()
from django_idempotency import telemetry
from django_idempotency.engine.unit import UnitOfWork
assert not telemetry.ENABLED
# Without opentelemetry the hooks hand the engine its methods back, unwrapped.
assert not hasattr(UnitOfWork.open, "__wrapped__") and not hasattr(UnitOfWork.close, "__wrapped__")
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django.test import Client
client = Client()
headers = {"Idempotency-Key": "k-1"}
first = client.post("/plain/", {"tag": "t"}, headers=headers)
again = client.post("/plain/", {"tag": "t"}, headers=headers)
print(first.status_code, again.status_code, again.headers.get("Idempotent-Replayed"))
print("opentelemetry" in sys.modules and sys.modules["opentelemetry"] is None)
"""


def test_the_package_works_without_opentelemetry() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["201 201 true", "True"]
