"""Webhook receivers: the payments API's ``POST /api/webhooks/processor/``, deduplicated by
``webhook-id`` per sender, behind a Standard Webhooks signature of the delivery id, the
timestamp and the body (``django_idempotency.contrib.standard_webhooks``); and the
``key_header`` and ``key_from`` options on their own."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.contrib.standard_webhooks import webhook_principal
from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from django_idempotency.rest_framework import IdempotencyMixin
from testproject.payments.models import Charge, Settlement
from testproject.processor import DELIVERY_HEADER, signed_headers
from tests.support.client import problem, replayed

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/webhooks/processor/"
SECRET = "whsec_dGVzdC13ZWJob29rLXNlY3JldC0zMi1ieXRlcy14eA=="
# Standard Webhooks' tolerance for a signature's time (the standardwebhooks package's).
WEBHOOK_TOLERANCE = 300


@pytest.fixture(autouse=True)
def secret() -> Any:
    with override_settings(PAYMENTS_WEBHOOK_SECRET=SECRET):
        yield


@pytest.fixture
def charge(token_user: Any) -> Charge:
    return Charge.objects.create(amount=2499, currency="inr", user=token_user.user)


def event(charge_id: int, kind: str = "charge.settled") -> bytes:
    return json.dumps({"type": kind, "data": {"charge": charge_id}}).encode()


def deliver(body: bytes, delivery: str | None, *, sign_with: str = SECRET, **extra: str) -> Any:
    headers = signed_headers(sign_with, delivery or "", body)
    if delivery is None:
        del headers[DELIVERY_HEADER]
    headers.update(extra)
    return Client().post(URL, body, content_type="application/json", headers=headers)


def test_a_delivery_marks_the_charge_settled_and_every_redelivery_gets_the_first_answer(
    charge: Charge,
) -> None:
    delivery = str(uuid.uuid4())
    body = event(charge.pk)
    first = deliver(body, delivery)
    assert first.status_code == 200 and first.json()["settled"] is True
    for _ in range(3):
        again = deliver(body, delivery)
        assert again.status_code == 200 and again.content == first.content
        assert again["Idempotent-Replayed"] == "true"
    assert Settlement.objects.filter(charge=charge).count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.scope, record.key) == ("webhook:processor", delivery)


def test_another_delivery_id_is_another_event(charge: Charge) -> None:
    deliver(event(charge.pk), str(uuid.uuid4()))
    deliver(event(charge.pk), str(uuid.uuid4()))
    assert Settlement.objects.count() == 2


def test_concurrent_redeliveries_settle_once(charge: Charge, settings: Any) -> None:
    # Waiting on (it is opt-in), so that the redeliveries wait for the first and replay it.
    settings.IDEMPOTENCY_WAIT = timedelta(seconds=5)
    settings.IDEMPOTENCY_MAX_WAITERS = 4
    delivery, body = str(uuid.uuid4()), event(charge.pk)
    answers: list[Any] = []

    def send() -> None:
        try:
            answers.append(deliver(body, delivery))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [a.status_code for a in answers] == [200] * 4
    assert len({a.content for a in answers}) == 1
    assert Settlement.objects.count() == 1


def test_a_bad_signature_is_refused_before_the_delivery_id_is_claimed(charge: Charge) -> None:
    delivery, body = str(uuid.uuid4()), event(charge.pk)
    forged = deliver(body, delivery, sign_with="whsec_bm90IHRoZSBzZWNyZXQ=")
    assert forged.status_code == 401
    assert not IdempotencyRecord.objects.exists() and not Settlement.objects.exists()
    # The genuine delivery of that id is not answered with the forger's 401.
    assert deliver(body, delivery).status_code == 200
    assert Settlement.objects.count() == 1


def test_a_delivery_without_its_id_is_refused_naming_the_header(charge: Charge) -> None:
    response = deliver(event(charge.pk), None)
    assert response.status_code == 400
    assert "webhook-id" in response.json()["detail"]
    assert not Settlement.objects.exists()


def test_an_event_for_a_charge_not_committed_yet_is_not_stored_so_the_retry_settles(
    token_user: Any,
) -> None:
    delivery = str(uuid.uuid4())
    missing = deliver(event(10**9), delivery)
    assert missing.status_code == 503 and not IdempotencyRecord.objects.exists()


def test_the_idempotency_key_header_does_not_stand_in_for_the_delivery_id(charge: Charge) -> None:
    response = deliver(event(charge.pk), None, **{"Idempotency-Key": "k"})
    assert response.status_code == 400 and not Settlement.objects.exists()


def test_a_captured_delivery_replayed_under_a_new_delivery_id_is_refused(charge: Charge) -> None:
    body, delivery = event(charge.pk), str(uuid.uuid4())
    captured = signed_headers(SECRET, delivery, body)
    first = Client().post(URL, body, content_type="application/json", headers=captured)
    assert first.status_code == 200
    # The same signed bytes under fresh ids: the signature covers the id, so none verifies.
    for _ in range(3):
        replayed = {**captured, DELIVERY_HEADER: str(uuid.uuid4())}
        again = Client().post(URL, body, content_type="application/json", headers=replayed)
        assert again.status_code == 401, again.content
    assert Settlement.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.parametrize("age", [WEBHOOK_TOLERANCE + 60, -(WEBHOOK_TOLERANCE + 60)])
def test_a_delivery_signed_outside_the_tolerance_is_refused_before_the_claim(
    charge: Charge, age: int
) -> None:
    body = event(charge.pk)
    headers = signed_headers(SECRET, str(uuid.uuid4()), body, at=time.time() - age)
    response = Client().post(URL, body, content_type="application/json", headers=headers)
    assert response.status_code == 401 and "timestamp too" in response.json()["detail"]
    assert not IdempotencyRecord.objects.exists() and not Settlement.objects.exists()


@pytest.mark.parametrize(
    ("header", "value", "status"),
    [
        ("webhook-signature", None, 400),
        ("webhook-timestamp", None, 400),
        ("webhook-signature", "v1,bm90IGEgc2lnbmF0dXJl", 401),
        ("webhook-signature", "no comma here", 401),
        ("webhook-timestamp", "yesterday", 401),
    ],
)
def test_a_missing_or_malformed_standard_webhooks_header_is_a_4xx_that_claims_nothing(
    charge: Charge, header: str, value: str | None, status: int
) -> None:
    body = event(charge.pk)
    headers = signed_headers(SECRET, str(uuid.uuid4()), body)
    if value is None:
        del headers[header]
    else:
        headers[header] = value
    response = Client().post(URL, body, content_type="application/json", headers=headers)
    assert response.status_code == status
    assert response["Content-Type"] == "application/problem+json"
    assert not IdempotencyRecord.objects.exists() and not Settlement.objects.exists()


def test_an_unusable_secret_is_a_misconfiguration_that_names_the_fix(charge: Charge) -> None:
    body = event(charge.pk)
    headers = signed_headers(SECRET, str(uuid.uuid4()), body)
    with (
        override_settings(PAYMENTS_WEBHOOK_SECRET=""),
        pytest.raises(ImproperlyConfigured, match=r'"whsec_" and base64'),
    ):
        Client().post(URL, body, content_type="application/json", headers=headers)
    assert not IdempotencyRecord.objects.exists()


def test_webhook_principal_refuses_a_request_that_was_not_verified() -> None:
    with pytest.raises(ImproperlyConfigured, match="above @idempotent"):
        webhook_principal(HttpRequest())


@pytest.fixture(scope="module")
def webhook_server(gunicorn_server: Any) -> Iterator[Any]:
    """The payments API under gunicorn, checking signatures with the tests' secret."""
    with gunicorn_server(workers=1, env={"PAYMENTS_WEBHOOK_SECRET": SECRET}) as server:
        yield server


def test_over_http_a_replayed_capture_under_a_new_id_settles_nothing_and_a_redelivery_replays(
    webhook_server: Any, charge: Charge
) -> None:
    url, body, delivery = webhook_server.url + URL, event(charge.pk), str(uuid.uuid4())
    captured = signed_headers(SECRET, delivery, body)
    first = requests.post(url, data=body, headers=captured, timeout=30)
    assert first.status_code == 200, first.text
    for _ in range(3):
        forged = {**captured, DELIVERY_HEADER: str(uuid.uuid4())}
        refused = requests.post(url, data=body, headers=forged, timeout=30)
        assert refused.status_code == 401, refused.text
    # The genuine redelivery (the same id, signed again a moment later) gets the first answer.
    redelivered = requests.post(url, data=body, headers=signed_headers(SECRET, delivery, body),
                                timeout=30)  # fmt: skip
    assert redelivered.status_code == 200 and redelivered.content == first.content
    assert redelivered.headers["Idempotent-Replayed"] == "true"
    assert Settlement.objects.filter(charge=charge).count() == 1


# Receivers of our own: two senders deduplicated by the same header, and a DRF receiver
# (the key_header option on its own: a real receiver verifies that its sender signs it).
RECEIVED: list[tuple[str, str]] = []


def _receiver(sender: str) -> Any:
    @csrf_exempt
    @idempotent(key_header="X-GitHub-Delivery", principal=lambda request: sender, required=True)
    def receive(request: HttpRequest) -> JsonResponse:
        RECEIVED.append((sender, request.headers["X-GitHub-Delivery"]))
        return JsonResponse({"sender": sender, "run": len(RECEIVED)})

    return receive


class DRFReceiver(IdempotencyMixin, APIView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []
    idempotency_key_header = "X-Shopify-Webhook-Id"
    idempotency_principal = staticmethod(lambda request: "shopify")
    idempotency_required = True

    def post(self, request: Any) -> Response:
        RECEIVED.append(("drf", request.headers["X-Shopify-Webhook-Id"]))
        return Response({"run": len(RECEIVED)})


def event_id(request: HttpRequest) -> Any:
    """A Stripe-like event's id, inside the (verified) JSON body; None if it has none."""
    try:
        event = json.loads(request.body)
    except ValueError:
        return None
    return event.get("id") if isinstance(event, dict) else None


def _stripe_like(required: bool) -> Any:
    @csrf_exempt
    @idempotent(key_from=event_id, principal=lambda request: "stripe", required=required)
    def receive(request: HttpRequest) -> JsonResponse:
        RECEIVED.append(("plain", str(event_id(request))))
        return JsonResponse({"run": len(RECEIVED)})

    return receive


@csrf_exempt
@idempotent(key_from=event_id, principal=lambda request: "stripe", required=True)
async def stripe_async(request: HttpRequest) -> JsonResponse:
    RECEIVED.append(("async", str(event_id(request))))
    return JsonResponse({"run": len(RECEIVED)})


class DRFEventReceiver(IdempotencyMixin, APIView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []
    # A plain function as the attribute: it comes back bound to the view, and is unbound.
    idempotency_key_from = event_id
    idempotency_principal = staticmethod(lambda request: "stripe")
    idempotency_required = True

    def post(self, request: Any) -> Response:
        RECEIVED.append(("drf", str(request.data.get("id"))))
        return Response({"run": len(RECEIVED)})


urlpatterns = [
    path("github/", _receiver("github")),
    path("gitlab/", _receiver("gitlab")),
    path("shopify/", DRFReceiver.as_view()),
    path("stripe/", _stripe_like(required=True)),
    path("stripe-optional/", _stripe_like(required=False)),
    path("stripe-async/", stripe_async),
    path("stripe-drf/", DRFEventReceiver.as_view()),
]
KEY_FROM_PATHS = ["/stripe/", "/stripe-async/", "/stripe-drf/"]

try:
    import ninja
except ImportError:  # an optional extra
    pass
else:
    from django_idempotency.ninja import idempotent_operation

    events_api = ninja.NinjaAPI(urls_namespace="webhook-tests", docs_url=None)

    @events_api.post("/stripe/")
    @idempotent_operation(key_from=event_id, principal=lambda request: "stripe", required=True)
    def stripe_ninja(request: HttpRequest) -> dict[str, int]:
        RECEIVED.append(("ninja", str(event_id(request))))
        return {"run": len(RECEIVED)}

    urlpatterns.append(path("ninja/", events_api.urls))
    KEY_FROM_PATHS.append("/ninja/stripe/")


@pytest.fixture
def received() -> Iterator[list[tuple[str, str]]]:
    RECEIVED.clear()
    yield RECEIVED
    RECEIVED.clear()


@pytest.mark.urls("tests.messaging.test_webhooks")
def test_delivery_ids_are_scoped_by_sender(received: list[tuple[str, str]]) -> None:
    client = Client()
    for _ in range(2):
        for sender in ("github", "gitlab"):
            client.post(f"/{sender}/", {}, content_type="application/json",
                        headers={"X-GitHub-Delivery": "same-id"})  # fmt: skip
    # Once per sender, whatever the number of deliveries.
    assert received == [("github", "same-id"), ("gitlab", "same-id")]
    assert set(IdempotencyRecord.objects.values_list("scope", "key")) == {
        ("github", "same-id"),
        ("gitlab", "same-id"),
    }


@pytest.mark.urls("tests.messaging.test_webhooks")
def test_the_drf_mixin_takes_the_key_header_as_an_attribute(
    received: list[tuple[str, str]],
) -> None:
    client = Client()
    answers = [
        client.post(
            "/shopify/",
            {"id": 1},
            content_type="application/json",
            headers={"X-Shopify-Webhook-Id": "d-1"},
        )
        for _ in range(3)
    ]
    assert {a.content for a in answers} == {answers[0].content}
    assert [a.headers.get("Idempotent-Replayed") for a in answers] == [None, "true", "true"]
    assert received == [("drf", "d-1")]
    missing = client.post("/shopify/", {"id": 1}, content_type="application/json")
    assert missing.status_code == 400 and "X-Shopify-Webhook-Id" in missing.json()["detail"]


def test_the_schema_documents_the_receivers_key_header() -> None:
    pytest.importorskip("drf_spectacular")
    from drf_spectacular.generators import SchemaGenerator

    import django_idempotency.contrib.spectacular  # noqa: F401  what AppConfig.ready() imports

    schema = SchemaGenerator(patterns=[path("shopify/", DRFReceiver.as_view())]).get_schema(
        request=None, public=True
    )
    parameters = schema["paths"]["/shopify/"]["post"]["parameters"]
    headers = {p["name"]: p for p in parameters if p["in"] == "header"}
    assert headers["X-Shopify-Webhook-Id"]["required"] is True
    assert "Idempotency-Key" not in headers


def post_event(path: str, event: Any) -> Any:
    body = event if isinstance(event, bytes) else json.dumps(event).encode()
    return Client().post(path, body, content_type="application/json")


@pytest.mark.urls("tests.messaging.test_webhooks")
@pytest.mark.parametrize("path", KEY_FROM_PATHS)
def test_key_from_deduplicates_on_the_event_id_in_the_body(
    received: list[tuple[str, str]], path: str
) -> None:
    event = {"id": "evt_1NG8Du2eZvKYlo2C", "type": "charge.succeeded"}
    answers = [post_event(path, event) for _ in range(3)]
    assert [a.status_code for a in answers] == [200] * 3
    assert {a.content for a in answers} == {answers[0].content}
    assert [replayed(a) for a in answers] == [False, True, True]
    assert [key for _, key in received] == ["evt_1NG8Du2eZvKYlo2C"]
    assert list(IdempotencyRecord.objects.values_list("scope", "key")) == [
        ("stripe", "evt_1NG8Du2eZvKYlo2C")
    ]
    # Another event id is another event.
    assert not replayed(post_event(path, {**event, "id": "evt_2"}))
    assert len(received) == 2


@pytest.mark.urls("tests.messaging.test_webhooks")
@pytest.mark.parametrize("path", KEY_FROM_PATHS)
@pytest.mark.parametrize(
    "bad",
    ["", "evt 1", "evt,1", "é", "x" * 256, 42, ["evt_1"], {"id": "evt_1"}],
    ids=["empty", "space", "comma", "non-ascii", "too-long", "int", "list", "object"],
)
def test_a_bad_key_from_value_is_400_invalid_key_and_runs_nothing(
    received: list[tuple[str, str]], path: str, bad: Any
) -> None:
    response = post_event(path, {"id": bad, "type": "charge.succeeded"})
    assert response.status_code == 400, response.content
    assert problem(response)["type"].endswith("invalid-key")
    assert received == [] and not IdempotencyRecord.objects.exists()


@pytest.mark.urls("tests.messaging.test_webhooks")
@pytest.mark.parametrize("path", KEY_FROM_PATHS)
@pytest.mark.parametrize("body", [b'{"type": "ping"}', b"not json", b"[1]"])
def test_no_key_from_a_required_receiver_is_400_missing_key(
    received: list[tuple[str, str]], path: str, body: bytes
) -> None:
    response = post_event(path, body)
    assert response.status_code == 400, response.content
    assert problem(response)["type"].endswith("missing-key")
    assert received == [] and not IdempotencyRecord.objects.exists()


@pytest.mark.urls("tests.messaging.test_webhooks")
def test_no_key_from_an_optional_receiver_runs_unprotected(
    received: list[tuple[str, str]],
) -> None:
    # As a request without an Idempotency-Key: it runs every time, and nothing is stored.
    answers = [post_event("/stripe-optional/", {"type": "ping"}) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert not any(replayed(a) for a in answers)
    assert len(received) == 2 and not IdempotencyRecord.objects.exists()
    assert replayed(post_event("/stripe-optional/", {"id": "evt_1"})) is False
    assert replayed(post_event("/stripe-optional/", {"id": "evt_1"})) is True
    assert len(received) == 3


@pytest.mark.urls("tests.messaging.test_webhooks")
def test_key_from_ignores_the_key_headers(received: list[tuple[str, str]]) -> None:
    # Only what key_from reads is the key: a header does not stand in for a missing id.
    response = Client().post(
        "/stripe/", b'{"type": "ping"}', content_type="application/json",
        headers={"Idempotency-Key": "k"},
    )  # fmt: skip
    assert response.status_code == 400 and received == []


def test_key_from_and_key_header_together_are_a_clear_error() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from django_idempotency.http.options import resolve

    with pytest.raises(ImproperlyConfigured, match="both key_header and key_from"):
        resolve({"key_from": event_id, "key_header": "X-Event-Id"})


def test_the_schema_of_a_key_from_receiver_shows_no_key_header() -> None:
    pytest.importorskip("drf_spectacular")
    from drf_spectacular.generators import SchemaGenerator

    import django_idempotency.contrib.spectacular  # noqa: F401  what AppConfig.ready() imports

    schema = SchemaGenerator(patterns=[path("events/", DRFEventReceiver.as_view())]).get_schema(
        request=None, public=True
    )
    parameters = schema["paths"]["/events/"]["post"].get("parameters", [])
    headers = {p["name"] for p in parameters if p["in"] == "header"}
    assert "Idempotency-Key" not in headers
    assert schema["paths"]["/events/"]["post"]["responses"]["400"]
