"""The request-time hooks through OpenTelemetry: the claim and replay spans, the outcome
counters and histograms, for requests sent through Django's test client and deliveries to an
exactly-once task; the outcome labels; and the package without opentelemetry."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

pytest.importorskip("opentelemetry.sdk")
from opentelemetry import metrics, trace
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.metrics._internal import _ProxyMeterProvider
from opentelemetry.trace import StatusCode

from django_idempotency.decorators import idempotent
from django_idempotency.engine import errors, instrumentation
from django_idempotency.engine.work import Refuse, Replay, Run
from django_idempotency.models import IdempotencyRecord
from tests.factories import ScriptFactory, UserFactory, new_key
from tests.support.claims import held_claim, unreachable_store
from tests.support.client import replayed, send
from tests.support.otel import collect_fixture, sdk_fixture  # noqa: F401  (the fixtures)
from tests.support.views import Boom

pytestmark = pytest.mark.urls("tests.support.urls")

SCRIPTED = "tests.support.views.ScriptedView"
PLAIN = "tests.support.views._plain"


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (errors.InProgress, "conflict"),
        (errors.KeyReused, "reused"),
        (errors.KeyExpired, "expired"),
        (errors.RolledBack, "rolled-back"),
        (errors.StoreUnavailable, "store-unavailable"),
        (errors.MissingKey, "refused"),
        (errors.InvalidKey, "refused"),
        (errors.PrincipalMissing, "refused"),
        (errors.Misconfigured, "refused"),
    ],
)
def test_each_error_and_its_refusal_carry_their_outcome_label(
    error: type[errors.IdempotencyError], outcome: str
) -> None:
    raised = error("detail")
    assert raised.outcome == outcome
    assert instrumentation.outcome_of(raised) == outcome
    assert Refuse(raised).outcome == outcome


def test_the_decisions_carry_their_outcome_labels_and_other_errors_are_errors() -> None:
    assert Run().outcome == "won"
    assert Replay.outcome == "replayed"
    assert instrumentation.outcome_of(RuntimeError("boom")) == "error"


@pytest.mark.django_db
def test_a_fresh_key_is_a_won_claim_span_and_a_won_request(client, collect: Any) -> None:
    response = send(client, "POST", "/drf/", ScriptFactory(), key=new_key())
    assert response.status_code == 201
    got = collect()
    (claim,) = got.named(instrumentation.CLAIM_SPAN)
    assert claim.attributes == {
        instrumentation.VIEW: SCRIPTED,
        instrumentation.KIND: "request",
        instrumentation.OUTCOME: "won",
    }
    assert claim.status.status_code is StatusCode.UNSET
    assert got.named(instrumentation.REPLAY_SPAN) == []
    assert got.count(instrumentation.REQUESTS, view=SCRIPTED, outcome="won") == 1
    assert got.count(instrumentation.REQUESTS) == 1
    (duration,) = got.recorded(instrumentation.CLAIM_DURATION, view=SCRIPTED, outcome="won")
    assert duration.count == 1 and 0 < duration.sum < 10
    # Only duplicates wait.
    assert got.recorded(instrumentation.WAIT_DURATION) == []


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
    (claim,) = got.named(instrumentation.CLAIM_SPAN)
    assert claim.attributes is not None
    assert claim.attributes[instrumentation.OUTCOME] == "replayed"
    assert claim.attributes[instrumentation.VIEW] == view
    (replay,) = got.named(instrumentation.REPLAY_SPAN)
    assert replay.attributes == {
        instrumentation.STATUS_CODE: 202,
        instrumentation.ENCODING: "identity",
    }
    assert got.count(instrumentation.REPLAYS, view=view, kind="request") == 1
    assert got.count(instrumentation.REQUESTS, view=view, outcome="replayed") == 1
    assert got.count(instrumentation.REQUESTS) == 1
    (waited,) = got.recorded(instrumentation.WAIT_DURATION, view=view, outcome="replayed")
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
    (claim,) = got.named(instrumentation.CLAIM_SPAN)
    assert claim.attributes is not None and claim.attributes[instrumentation.OUTCOME] == "conflict"
    assert got.count(instrumentation.CONFLICTS, view=SCRIPTED) == 1
    assert got.count(instrumentation.REQUESTS, outcome="conflict") == 1
    (waited,) = got.recorded(instrumentation.WAIT_DURATION, outcome="conflict")
    # The duplicate waited the second it asked for, and no longer than it was kept.
    assert 0.9 <= waited.sum <= elapsed


@pytest.mark.django_db
def test_a_422_reuse_is_counted_and_not_replayed(client, collect: Any) -> None:
    key = new_key()
    send(client, "POST", "/drf/", ScriptFactory(), key=key)
    response = send(client, "POST", "/drf/", ScriptFactory(), key=key)
    assert response.status_code == 422
    got = collect()
    outcomes = [
        span.attributes[instrumentation.OUTCOME] for span in got.named(instrumentation.CLAIM_SPAN)
    ]
    assert outcomes == ["won", "reused"]
    assert got.count(instrumentation.REQUESTS, view=SCRIPTED, outcome="reused") == 1
    assert got.count(instrumentation.REPLAYS) == 0
    assert got.named(instrumentation.REPLAY_SPAN) == []


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "view"), [("/drf/", SCRIPTED), ("/plain/", PLAIN)])
def test_a_503_store_unavailable_is_counted_and_its_span_is_an_error(
    client, settings, collect: Any, path: str, view: str
) -> None:
    with unreachable_store(settings):
        response = send(client, "POST", path, ScriptFactory(), key=new_key())
    assert response.status_code == 503
    got = collect()
    (claim,) = got.named(instrumentation.CLAIM_SPAN)
    assert claim.attributes is not None
    assert claim.attributes[instrumentation.OUTCOME] == "store-unavailable"
    assert claim.status.status_code is StatusCode.ERROR
    assert claim.status.description == "StoreUnavailable"
    assert got.count(instrumentation.STORE_UNAVAILABLE, view=view) == 1
    assert got.count(instrumentation.REQUESTS, view=view, outcome="store-unavailable") == 1


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
    assert got.count(instrumentation.REQUESTS, view=SCRIPTED, outcome="expired") == 1
    assert len(got.recorded(instrumentation.WAIT_DURATION, outcome="expired")) == 1


@pytest.mark.django_db
def test_an_engine_error_at_the_close_is_counted_as_error(client, settings, collect: Any) -> None:
    settings.IDEMPOTENCY_MAX_RESPONSE_BYTES = 10
    with pytest.raises(ImproperlyConfigured):
        send(client, "POST", "/plain/", ScriptFactory(), key=new_key())
    got = collect()
    assert got.count(instrumentation.REQUESTS, view=PLAIN, outcome="error") == 1


@pytest.mark.django_db
def test_a_request_refused_before_its_claim_is_counted_without_a_claim_span(
    client, collect: Any
) -> None:
    response = send(client, "POST", "/drf/required/", ScriptFactory())
    assert response.status_code == 400
    got = collect()
    assert got.named(instrumentation.CLAIM_SPAN) == []
    assert got.count(instrumentation.REQUESTS, view=SCRIPTED, outcome="refused") == 1


@pytest.mark.django_db
def test_a_rolled_back_success_is_counted_as_rolled_back(client, collect: Any) -> None:
    response = send(client, "POST", "/drf/", ScriptFactory(rollback_only=True), key=new_key())
    assert response.status_code == 500
    got = collect()
    assert got.count(instrumentation.ROLLED_BACK, view=SCRIPTED) == 1
    assert got.count(instrumentation.REQUESTS, view=SCRIPTED, outcome="rolled-back") == 1
    assert got.count(instrumentation.REQUESTS, outcome="won") == 0


@pytest.mark.django_db
def test_a_view_that_raises_is_counted_as_failed(client, collect: Any) -> None:
    with pytest.raises(Boom):
        send(client, "POST", "/plain/", ScriptFactory(fail="raise"), key=new_key())
    got = collect()
    assert got.count(instrumentation.REQUESTS, view=PLAIN, outcome="failed") == 1


@pytest.mark.django_db
def test_requests_without_a_key_leave_no_telemetry(client, collect: Any) -> None:
    assert send(client, "POST", "/drf/", ScriptFactory()).status_code == 201
    got = collect()
    assert got.spans == [] and got.count(instrumentation.REQUESTS) == 0


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
    outcomes = {
        span.attributes[instrumentation.OUTCOME] for span in got.named(instrumentation.CLAIM_SPAN)
    }
    assert outcomes == {"won", "replayed", "reused", "conflict", "store-unavailable"}
    values = got.every_value()
    assert values
    for value in values:
        assert principal not in value
        assert user.username not in value
        for key in keys:
            assert key not in value and key[:8] not in value


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
    monkeypatch.setattr(instrumentation, "_heard", False)
    monkeypatch.setattr(instrumentation, "_environment_read", False)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: tracer_provider)
    monkeypatch.setattr(metrics, "get_meter_provider", lambda: meter_provider)
    if globals_kept:
        monkeypatch.setattr(trace, "_TRACER_PROVIDER", tracer_provider)
        monkeypatch.setattr(metrics_internal, "_METER_PROVIDER", meter_provider)
    else:
        monkeypatch.delattr(trace, "_TRACER_PROVIDER")
        monkeypatch.delattr(metrics_internal, "_METER_PROVIDER")
    key, script = new_key(), ScriptFactory()
    assert send(client, "POST", "/drf/", script, key=key).status_code == 201
    assert replayed(send(client, "POST", "/drf/", script, key=key))
    assert send(client, "POST", "/drf/required/", ScriptFactory()).status_code == 400
    with pytest.raises(Boom):
        send(client, "POST", "/plain/", ScriptFactory(fail="raise"), key=new_key())
    assert not instrumentation.listening()
    got = collect()
    assert got.spans == [] and got.count(instrumentation.REQUESTS) == 0
    assert got.recorded(instrumentation.CLAIM_DURATION) == []
    monkeypatch.undo()
    # The SDK's providers are set: heard from now on.
    assert instrumentation.listening()


def test_a_provider_named_by_the_environment_is_loaded_and_heard(
    sdk: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = trace.get_tracer_provider()
    monkeypatch.setattr(instrumentation, "_heard", False)
    monkeypatch.setattr(instrumentation, "_environment_read", False)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(metrics_internal, "_METER_PROVIDER", None)
    loads: list[str] = []

    def from_environment() -> Any:
        # What the API's getter does when OTEL_PYTHON_TRACER_PROVIDER names a provider.
        loads.append("tracer")
        trace._TRACER_PROVIDER = provider
        return provider

    monkeypatch.setattr(trace, "get_tracer_provider", from_environment)
    assert instrumentation.listening() and instrumentation.listening()
    assert loads == ["tracer"]


@pytest.mark.django_db(transaction=True)
def test_a_redelivered_message_answered_from_the_store_is_counted(collect: Any) -> None:
    pytest.importorskip("celery")
    from tests.messaging.test_consumers import GATE, deliver, note

    GATE.set()  # note's body waits for it
    message_id = str(uuid.uuid4())
    assert deliver(note, message_id, 1).state == "SUCCESS"
    assert deliver(note, message_id, 1).state == "SUCCESS"
    got = collect()
    view = "tests.consumers.note"  # the task's name
    assert got.count(instrumentation.REDELIVERED, view=view) == 1
    messaging = {"messaging.operation.name": "process", "messaging.destination.name": view}
    assert got.count(instrumentation.REDELIVERED, **messaging) == 1
    assert got.count(instrumentation.REQUESTS, view=view, kind="task", outcome="won") == 1
    assert got.count(instrumentation.REPLAYS, view=view, kind="task") == 1
    spans = got.named(instrumentation.CLAIM_SPAN)
    assert [span.attributes[instrumentation.OUTCOME] for span in spans] == ["won", "replayed"]


@csrf_exempt
@idempotent(allow_anonymous=True)
async def async_charge(request: HttpRequest) -> JsonResponse:
    group = await Group.objects.acreate(name=f"async:{uuid.uuid4().hex}")
    return JsonResponse({"group": group.pk}, status=201)


urlpatterns = [path("async/", async_charge)]
ASYNC_VIEW = "tests.engine.test_instrumentation.async_charge"


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls("tests.engine.test_instrumentation")
def test_an_async_views_claim_is_a_child_of_the_request_span(client, collect: Any) -> None:
    key = new_key()
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /async/") as server:
        assert send(client, "POST", "/async/", {}, key=key).status_code == 201
    with tracer.start_as_current_span("POST /async/ again") as retry:
        again = send(client, "POST", "/async/", {}, key=key)
    assert replayed(again)
    got = collect()
    claims = got.named(instrumentation.CLAIM_SPAN)
    assert [span.attributes[instrumentation.OUTCOME] for span in claims] == ["won", "replayed"]
    assert {span.attributes[instrumentation.VIEW] for span in claims} == {ASYNC_VIEW}
    first = claims[0]
    assert first.parent is not None
    assert first.parent.span_id == server.get_span_context().span_id
    (replay,) = got.named(instrumentation.REPLAY_SPAN)
    assert claims[1].parent is not None and replay.parent is not None
    assert claims[1].parent.span_id == replay.parent.span_id == retry.get_span_context().span_id
    assert got.count(instrumentation.REQUESTS, view=ASYNC_VIEW, outcome="won") == 1
    assert got.count(instrumentation.REPLAYS, view=ASYNC_VIEW) == 1


PROBE = """
import sys
sys.modules["opentelemetry"] = None  # any "import opentelemetry..." now raises ImportError
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes",
                    "django.contrib.sessions", "rest_framework", "rest_framework.authtoken",
                    "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True, ROOT_URLCONF="tests.support.urls", ALLOWED_HOSTS=["testserver"],
)
import django
django.setup()
from django_idempotency import telemetry
from django_idempotency.engine import instrumentation
from django_idempotency.engine.unit import UnitOfWork
assert not instrumentation.ENABLED and not telemetry.ENABLED
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


PRIVATE_GONE = """
import sys
from opentelemetry.metrics import _internal
# An API release that moved its private proxy class: importing the package reads no such
# name, and the hooks still tell a process with no provider set.
del _internal._ProxyMeterProvider
import django
django.setup()
from django_idempotency.engine import instrumentation
from django_idempotency.messaging import tracing
assert instrumentation.ENABLED and not instrumentation.listening()
print("ok")
"""


def test_importing_the_hooks_touches_no_private_opentelemetry_attribute() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PRIVATE_GONE],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


def test_the_package_works_without_opentelemetry() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["201 201 true", "True"]


@pytest.mark.django_db
def test_a_principal_past_the_bound_on_stored_4xx_is_counted_and_signalled_once(
    collect: Any, client: Any, settings: Any
) -> None:
    from django_idempotency import signals

    settings.IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE = 2
    tenant = new_key()
    sent: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append(kwargs)

    signals.stored_errors_limited.connect(receiver)
    try:
        for _ in range(5):
            script = ScriptFactory(reject="invalid")
            send(
                client, "POST", "/drf/tenant/", script, key=new_key(), headers={"X-Tenant": tenant}
            )
    finally:
        signals.stored_errors_limited.disconnect(receiver)

    assert collect().count(instrumentation.ERRORS_LIMITED, view=SCRIPTED) == 1
    assert [(s["principal"], s["limit"], s["view"]) for s in sent] == [
        (f"tenant:{tenant}", 2, SCRIPTED)
    ]
