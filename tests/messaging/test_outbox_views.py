"""docs/outbox.md's example over HTTP: a protected view that enqueues answers its keyless
requests as its keyed ones (issue 29): the view runs in a transaction either way, and what it
enqueued is in the outbox if and only if its writes commit."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import requests
from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics

from django_idempotency.decorators import idempotent
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from django_idempotency.rest_framework import IdempotencyMixin
from testproject.payments.models import Charge
from testproject.payments.serializers import ChargeSerializer
from testproject.payments.tasks import post_ledger_entry

pytestmark = [
    pytest.mark.urls("tests.messaging.test_outbox_views"),
    pytest.mark.django_db(transaction=True),
]


# As docs/outbox.md writes it (and a failure on demand).
class ChargeCreate(IdempotencyMixin, generics.CreateAPIView):  # type: ignore[type-arg]
    queryset = Charge.objects.all()
    serializer_class = ChargeSerializer

    def perform_create(self, serializer: Any) -> None:
        charge = serializer.save(user=self.request.user)
        enqueue_task(post_ledger_entry, (charge.pk,), {"amount": charge.amount}, queue="ledger")
        enqueue_event("charge.created", {"charge": charge.pk})
        if charge.currency == "xxx":
            raise RuntimeError("the charge failed after its messages were enqueued")


@csrf_exempt
@idempotent(allow_anonymous=True)
def plain_charge(request: HttpRequest) -> JsonResponse:
    enqueue_event("charge.created", {"plain": True})
    status = int(request.GET.get("status", "201"))
    return JsonResponse({"status": status}, status=status)


@csrf_exempt
@idempotent(allow_anonymous=True)
async def async_charge(request: HttpRequest) -> JsonResponse:
    # Django's async ORM runs on the request's one sync thread, where the transaction is.
    await sync_to_async(enqueue_event)("charge.created", {"async": True})
    status = int(request.GET.get("status", "201"))
    return JsonResponse({"status": status}, status=status)


urlpatterns = [
    path("charges/", ChargeCreate.as_view()),
    path("plain/", plain_charge),
    path("async/", async_charge),
]


def post(base: str, user: Any, body: dict[str, Any], key: str | None) -> requests.Response:
    headers = dict(user.headers)
    if key is not None:
        headers["Idempotency-Key"] = key
    return requests.post(f"{base}/charges/", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
def test_the_outbox_example_enqueues_with_a_key_or_without_one(
    live_server: Any, make_token_user: Any, keyed: bool
) -> None:
    user = make_token_user()
    body = {"amount": 2499, "currency": "inr"}
    key = str(uuid.uuid4()) if keyed else None

    answer = post(live_server.url, user, body, key)

    assert answer.status_code == 201, answer.text
    charge = Charge.objects.get()
    rows = {row.name: row for row in OutboxMessage.objects.all()}
    assert rows[post_ledger_entry.name].args == [charge.pk]
    assert rows["charge.created"].payload == {"charge": charge.pk}
    assert IdempotencyRecord.objects.count() == (1 if keyed else 0)


def test_a_keyless_request_that_fails_after_enqueueing_leaves_nothing(
    live_server: Any, make_token_user: Any
) -> None:
    user = make_token_user()
    body = {"amount": 1, "currency": "xxx"}

    answer = post(live_server.url, user, body, None)

    assert answer.status_code == 500
    assert not Charge.objects.exists() and not OutboxMessage.objects.exists()


@pytest.mark.parametrize("view", ["plain", "async"])
@pytest.mark.parametrize(("status", "kept"), [(201, 1), (400, 1), (503, 0)])
def test_a_keyless_plain_view_commits_its_messages_unless_it_answers_5xx(
    live_server: Any, status: int, kept: int, view: str
) -> None:
    answer = requests.post(f"{live_server.url}/{view}/?status={status}", json={}, timeout=30)

    assert answer.status_code == status
    assert OutboxMessage.objects.count() == kept
