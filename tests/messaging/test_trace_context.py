"""Trace context through the outbox: the enqueuing request's W3C context is stored with the
message, the relay publishes under a span of that trace and sends it in the destination's
headers (Celery message headers, NATS headers), and an exactly-once consumer's span continues
it, so that one trace shows request -> relay publish -> task. With no tracer provider set,
nothing is stored. The worker is a real Celery worker (in a thread) on a private Redis."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import uuid
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from django_idempotency.decorators import idempotent
from django_idempotency.engine.instrumentation import CLAIM_SPAN, KIND
from django_idempotency.messaging import tracing
from django_idempotency.messaging.consumers.celery import ExactlyOnceTask
from django_idempotency.messaging.consumers.nats import NatsConsumer
from django_idempotency.messaging.consumers.tasks import deliver
from django_idempotency.messaging.destinations import CELERY, NATS, TASKS
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task
from django_idempotency.messaging.relay.loop import PublishFailed, Relay
from django_idempotency.messaging.tasks_framework import task_backends
from django_idempotency.models import OutboxMessage
from tests.conftest import ROOT
from tests.messaging.test_relay import bare_app
from tests.support.chain_processes import RedisServer, wait_for
from tests.support.nats_server import NatsServer
from tests.support.otel import SPANS, collect_fixture, sdk_fixture  # noqa: F401  (fixtures)
from tests.support.task_targets import record

pytestmark = [
    pytest.mark.urls("tests.messaging.test_trace_context"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(120),
]

TASK = "tests.trace.settle"


def sending(span: ReadableSpan) -> bool:
    return (span.attributes or {}).get(tracing.OPERATION_NAME) == tracing.SEND


def processing(span: ReadableSpan) -> bool:
    return (span.attributes or {}).get(tracing.OPERATION_NAME) == tracing.PROCESS


FAILING = "tests.trace.fail"
SECRET = "key-4f1c-never-exported"
SETTLED: list[str] = []


@csrf_exempt
@idempotent(allow_anonymous=True)
def charge(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"task_id": enqueue_task(TASK, (42,))}, status=201)


urlpatterns = [path("charge/", charge)]


def request_span(client: Client) -> tuple[ReadableSpan | Any, str]:
    """POST /charge/ under a server span (standing for the web framework's instrumentation);
    the span and the message id the view enqueued."""
    tracer = trace.get_tracer("tests.trace")
    with tracer.start_as_current_span("POST /charge/", kind=SpanKind.SERVER) as span:
        response = client.post("/charge/", headers={"Idempotency-Key": str(uuid.uuid4())})
    assert response.status_code == 201, response.content
    return span, response.json()["task_id"]


def carried(headers: dict[str, str]) -> tuple[int, int]:
    """The trace and span id that W3C headers name."""
    found = trace.get_current_span(propagate.extract(headers)).get_span_context()
    return found.trace_id, found.span_id


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@pytest.fixture
def app(private_redis: RedisServer) -> Celery:
    SETTLED.clear()
    app = bare_app(private_redis.url, "trace-tests")

    @app.task(name=TASK, base=ExactlyOnceTask, bind=True, shared=False)
    def settle(self: Any, charge: int) -> int:
        SETTLED.append(str(self.request.id))
        return charge

    @app.task(name=FAILING, base=ExactlyOnceTask, bind=True, shared=False)
    def fail(self: Any, charge: int) -> int:
        raise ValueError(f"card {SECRET} declined")

    return app


def test_one_trace_shows_the_request_the_relay_publish_and_the_exactly_once_task(
    collect: Any, app: Celery, django_db_blocker: Any
) -> None:
    request, message_id = request_span(Client())
    stored = OutboxMessage.objects.get().options[tracing.TRACE_OPTION]
    context = request.get_span_context()
    assert carried(stored) == (context.trace_id, context.span_id)

    assert Relay(app=app).drain() == 1
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        wait_for(lambda: [message_id] == SETTLED)
    # The worker's thread ends its span once the task has returned.
    wait_for(lambda: any(processing(s) for s in SPANS.get_finished_spans()))
    spans = collect().spans
    (publish,) = [s for s in spans if sending(s)]
    (consume,) = [s for s in spans if processing(s)]
    (task_claim,) = [
        s for s in spans if s.name == CLAIM_SPAN and s.attributes[KIND] == "task"
    ]  # fmt: skip
    assert {s.context.trace_id for s in (publish, consume, task_claim)} == {context.trace_id}
    assert parent_of(publish) == context.span_id and publish.kind == SpanKind.PRODUCER
    assert parent_of(consume) == publish.context.span_id and consume.kind == SpanKind.CONSUMER
    assert parent_of(task_claim) == consume.context.span_id
    assert publish.attributes[tracing.MESSAGE_ID] == message_id
    assert consume.attributes[tracing.MESSAGE_ID] == message_id
    # OpenTelemetry's messaging conventions: "{operation} {destination}", and their attributes.
    assert (publish.name, consume.name) == (f"send {TASK}", f"process {TASK}")
    for span, operation in ((publish, "send"), (consume, "process")):
        assert span.attributes[tracing.SYSTEM] == "redis"
        assert span.attributes[tracing.OPERATION_NAME] == operation
        assert span.attributes[tracing.OPERATION] == operation
        assert span.attributes[tracing.DESTINATION] == TASK


def ancestry(span: ReadableSpan, spans: list[ReadableSpan]) -> list[str]:
    """The names of ``span``'s parents, nearest first, as far as ``spans`` hold them."""
    by_id = {s.context.span_id: s for s in spans}
    names: list[str] = []
    found = by_id.get(parent_of(span) or 0)
    while found is not None:
        names.append(found.name)
        found = by_id.get(parent_of(found) or 0)
    return names


def test_under_celerys_own_instrumentation_its_task_span_continues_the_trace(
    collect: Any, app: Celery
) -> None:
    instrumentation = pytest.importorskip("opentelemetry.instrumentation.celery")
    instrumentor = instrumentation.CeleryInstrumentor()
    instrumentor.instrument()
    try:
        tracer = trace.get_tracer("tests.trace")
        with tracer.start_as_current_span("POST /charge/", kind=SpanKind.SERVER) as request:
            response = Client().post("/charge/", headers={"Idempotency-Key": str(uuid.uuid4())})
        message_id = response.json()["task_id"]
        assert Relay(app=app).drain() == 1
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            wait_for(lambda: [message_id] == SETTLED)
        wait_for(lambda: any(s.name == f"run/{TASK}" for s in SPANS.get_finished_spans()))
    finally:
        instrumentor.uninstrument()
    spans = collect().spans
    (task_claim,) = [s for s in spans if s.name == CLAIM_SPAN and s.attributes[KIND] == "task"]
    # The instrumentation's task span, and no consume span of the package's own beside it.
    chain = ancestry(task_claim, spans)
    assert chain[0] == f"run/{TASK}" and f"process {TASK}" not in chain
    assert chain[-2:] == [f"send {TASK}", "POST /charge/"]
    trace_id = request.get_span_context().trace_id
    assert task_claim.context.trace_id == trace_id


def test_with_tracing_off_in_the_relay_the_stored_context_goes_out_as_it_is(
    collect: Any, app: Celery, private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    request_span(Client())
    stored = OutboxMessage.objects.get().options[tracing.TRACE_OPTION]
    monkeypatch.setattr(tracing, "listening", lambda: False)
    Relay(app=app).drain()
    (headers,) = private_redis.queued()
    assert headers["traceparent"] == stored["traceparent"]
    assert not [s for s in collect().spans if sending(s)]


def test_a_task_with_a_countdown_carries_the_context_too(
    collect: Any, app: Celery, private_redis: RedisServer
) -> None:
    # Sent through app.send_task() (an eta), not the relay's own fast path.
    tracer = trace.get_tracer("tests.trace")
    with tracer.start_as_current_span("POST /later/"), transaction.atomic():
        enqueue_task(TASK, (3,), countdown=60)
    Relay(app=app).drain()
    (headers,) = private_redis.queued()
    (publish,) = [s for s in collect().spans if sending(s)]
    assert headers["eta"] is not None
    assert carried(headers) == (publish.context.trace_id, publish.context.span_id)


def test_a_message_enqueued_outside_any_span_carries_no_context_and_no_header(
    collect: Any, app: Celery, private_redis: RedisServer
) -> None:
    with transaction.atomic():
        enqueue_task(TASK, (1,))
    assert tracing.TRACE_OPTION not in OutboxMessage.objects.get().options
    Relay(app=app).drain()
    (headers,) = private_redis.queued()
    assert "traceparent" not in headers
    assert not [s for s in collect().spans if sending(s)]


def test_an_eager_call_with_trace_headers_continues_the_trace(collect: Any, app: Celery) -> None:
    settle = app.tasks[TASK]
    parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    settle.apply((5,), task_id=str(uuid.uuid4()), headers=parent)
    (consume,) = [s for s in collect().spans if processing(s)]
    assert consume.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert parent_of(consume) == 0xB7AD6B7169203331


def refuse_with_a_secret(name: str, args: Any, kwargs: Any, options: Any, **extra: Any) -> None:
    raise ValueError(f"no route for {SECRET}")


def test_failed_publishes_and_consumers_say_the_errors_type_only(collect: Any, app: Celery) -> None:
    parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    app.tasks[FAILING].apply((5,), task_id=str(uuid.uuid4()), headers=parent)
    with trace.get_tracer("tests.trace").start_as_current_span("POST /x/"), transaction.atomic():
        enqueue_task(TASK, (1,))
    app.conf.task_routes = (refuse_with_a_secret,)
    with pytest.raises(PublishFailed):
        Relay(app=app).drain()
    got = collect()
    (consume,) = [s for s in got.spans if processing(s)]
    (publish,) = [s for s in got.spans if sending(s)]
    assert consume.status.status_code == publish.status.status_code == StatusCode.ERROR
    assert consume.status.description == publish.status.description == "ValueError"
    assert not [value for value in got.every_value() if SECRET in value]


def test_a_consumer_under_a_span_already_current_makes_no_span_of_its_own(
    collect: Any, app: Celery
) -> None:
    # As under Celery's own OpenTelemetry instrumentation, whose task span is current.
    with trace.get_tracer("tests.trace").start_as_current_span("run/tests.trace.settle") as run:
        app.tasks[TASK].apply((6,), task_id=str(uuid.uuid4()))
    spans = collect().spans
    assert not [s for s in spans if processing(s)]
    (claim,) = [s for s in spans if s.name == CLAIM_SPAN]
    assert parent_of(claim) == run.get_span_context().span_id


# NATS -----------------------------------------------------------------------------------


def test_nats_messages_carry_the_publish_spans_context_in_their_headers(
    collect: Any, nats_server: NatsServer
) -> None:
    nats_server.add_stream()
    tracer = trace.get_tracer("tests.trace")
    with tracer.start_as_current_span("POST /capture/") as request, transaction.atomic():
        event = enqueue_event("payments.captured", {"charge": 7})
    options = {"servers": [nats_server.url], "subject": "outbox.{name}", "ack_timeout": 2}
    with override_settings(
        IDEMPOTENCY_OUTBOX_DESTINATIONS={"default": {"BACKEND": NATS, "OPTIONS": options}},
    ):
        relay = Relay()
        try:
            assert relay.drain() == 1
        finally:
            relay.destinations.close()
    (publish,) = [s for s in collect().spans if sending(s)]
    assert parent_of(publish) == request.get_span_context().span_id
    assert publish.attributes[tracing.OUTBOX_DESTINATION] == "default"
    assert publish.attributes[tracing.DESTINATION] == "outbox.payments.captured"
    assert publish.name == "send outbox.payments.captured"
    assert publish.attributes[tracing.SYSTEM] == "nats"
    headers = nats_server.message(1).headers
    assert headers["Nats-Msg-Id"] == event
    assert carried(headers) == (request.get_span_context().trace_id, publish.context.span_id)

    # The exactly-once NATS consumer continues the trace: its span is the publish span's child.
    handled: list[str] = []
    consumer = NatsConsumer(
        lambda message: handled.append(message.id),
        stream="OUTBOX",
        durable="traced",
        servers=[nats_server.url],
    )
    try:
        assert consumer.poll(timeout=5) == 1
    finally:
        consumer.close()
    assert handled == [event]
    (consume,) = [s for s in collect().spans if processing(s)]
    assert consume.context.trace_id == request.get_span_context().trace_id
    assert parent_of(consume) == publish.context.span_id
    assert consume.attributes[tracing.MESSAGE_ID] == event
    assert consume.name == "process outbox.payments.captured"
    assert consume.attributes[tracing.SYSTEM] == "nats"


# Django's Tasks framework ---------------------------------------------------------------


def test_the_django_tasks_runner_continues_the_trace_its_message_carried(collect: Any) -> None:
    tracer = trace.get_tracer("tests.trace")
    with tracer.start_as_current_span("send tests.support.task_targets.record") as publish:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    message_id = str(uuid.uuid4())
    deliver.func(None, message_id, "tests.support.task_targets.record", [1], {}, trace=carrier)
    spans = collect()
    (consume,) = [s for s in spans.spans if processing(s)]
    assert parent_of(consume) == publish.get_span_context().span_id
    assert consume.attributes[tracing.MESSAGE_ID] == message_id
    assert consume.name == "process tests.support.task_targets.record"
    assert consume.attributes[tracing.SYSTEM] == "django_tasks"
    (claim,) = spans.named(CLAIM_SPAN)
    assert parent_of(claim) == consume.context.span_id


def test_the_django_tasks_destination_hands_the_runner_the_publish_spans_context(
    collect: Any,
) -> None:
    package = "django.tasks" if importlib.util.find_spec("django.tasks") else "django_tasks"
    with contextlib.suppress(ImportError):  # the backport forgets its backends on a change
        import django_tasks.signals  # noqa: F401
    with override_settings(
        TASKS={
            "default": {
                "BACKEND": "django_idempotency.messaging.task_backend.OutboxBackend",
                "OPTIONS": {"backend": "dummy"},
            },
            "dummy": {"BACKEND": f"{package}.backends.dummy.DummyBackend"},
        },
        IDEMPOTENCY_OUTBOX_DESTINATIONS={
            "default": {"BACKEND": CELERY},
            "tasks": {"BACKEND": TASKS},
        },
    ):
        tracer = trace.get_tracer("tests.trace")
        with tracer.start_as_current_span("POST /charge/") as request, transaction.atomic():
            record.enqueue(3)
        relay = Relay()
        try:
            assert relay.drain() == 1
        finally:
            relay.destinations.close()
        (handed,) = task_backends["dummy"].results
    (publish,) = [s for s in collect().spans if sending(s)]
    assert parent_of(publish) == request.get_span_context().span_id
    assert carried(handed.kwargs["trace"]) == (
        request.get_span_context().trace_id,
        publish.context.span_id,
    )


# Tracing off ----------------------------------------------------------------------------

NO_PROVIDER = """
import json, django
django.setup()
from django.db import transaction
from opentelemetry import context, propagate
from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.models import OutboxMessage
# A valid remote parent is current, but no tracer provider is set: nothing is stored.
parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
token = context.attach(propagate.extract(parent))
with transaction.atomic():
    message_id = enqueue_task("tests.trace.settle", (1,))
print(json.dumps(OutboxMessage.objects.get(pk=message_id).options))
"""


def test_with_no_tracer_provider_nothing_is_stored(subprocess_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_PROVIDER], cwd=ROOT, env=subprocess_env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
