"""Webhook receivers: the payments API's ``POST /api/webhooks/processor/``, deduplicated by
``X-Processor-Delivery`` per sender, behind an HMAC-SHA256 signature check; and the
``key_header`` option on its own."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from django_idempotency.rest_framework import IdempotencyMixin
from testproject.payments.chain import signature
from testproject.payments.models import Charge, Settlement

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/webhooks/processor/"
SECRET = "test-webhook-secret"


@pytest.fixture(autouse=True)
def secret() -> Any:
    with override_settings(PAYMENTS_WEBHOOK_SECRET=SECRET):
        yield


@pytest.fixture
def charge(token_user: Any) -> Charge:
    return Charge.objects.create(amount=2499, currency="inr", user=token_user.user)


def event(charge_id: int, kind: str = "charge.settled") -> bytes:
    return json.dumps({"type": kind, "data": {"charge": charge_id}}).encode()


def deliver(body: bytes, delivery: str | None, *, sign_with: str = SECRET) -> Any:
    headers = {"X-Processor-Signature": signature(sign_with, body)}
    if delivery is not None:
        headers["X-Processor-Delivery"] = delivery
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
    forged = deliver(body, delivery, sign_with="not the secret")
    assert forged.status_code == 401
    assert not IdempotencyRecord.objects.exists() and not Settlement.objects.exists()
    # The genuine delivery of that id is not answered with the forger's 401.
    assert deliver(body, delivery).status_code == 200
    assert Settlement.objects.count() == 1


def test_a_delivery_without_its_id_is_refused_naming_the_header(charge: Charge) -> None:
    response = deliver(event(charge.pk), None)
    assert response.status_code == 400
    assert "X-Processor-Delivery" in response.json()["detail"]
    assert not Settlement.objects.exists()


def test_an_event_for_a_charge_not_committed_yet_is_not_stored_so_the_retry_settles(
    token_user: Any,
) -> None:
    delivery = str(uuid.uuid4())
    missing = deliver(event(10**9), delivery)
    assert missing.status_code == 503 and not IdempotencyRecord.objects.exists()


def test_the_idempotency_key_header_does_not_stand_in_for_the_delivery_id(charge: Charge) -> None:
    body = event(charge.pk)
    response = Client().post(
        URL,
        body,
        content_type="application/json",
        headers={"X-Processor-Signature": signature(SECRET, body), "Idempotency-Key": "k"},
    )
    assert response.status_code == 400 and not Settlement.objects.exists()


# Receivers of our own: two senders deduplicated by the same header, and a DRF receiver.
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


urlpatterns = [
    path("github/", _receiver("github")),
    path("gitlab/", _receiver("gitlab")),
    path("shopify/", DRFReceiver.as_view()),
]


@pytest.fixture
def received() -> Iterator[list[tuple[str, str]]]:
    RECEIVED.clear()
    yield RECEIVED
    RECEIVED.clear()


@pytest.mark.urls("tests.test_webhooks")
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


@pytest.mark.urls("tests.test_webhooks")
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
