"""Message and event ids named by the request (issue 33): a keyed request that runs again
after its commit was lost (an asynchronous failover; here its record and writes deleted)
writes the same outbox and event ids, so the consumer that saw the first publication drops
the second; a keyless request's ids stay random."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("celery")
from celery import shared_task
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.test import Client
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.decorators import idempotent
from django_idempotency.messaging import emit_event
from django_idempotency.messaging.consumers.celery import ExactlyOnceTask
from django_idempotency.messaging.downstream import derive_key
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task
from django_idempotency.models import IdempotencyRecord, OutboxEvent, OutboxMessage

pytestmark = [
    pytest.mark.urls("tests.messaging.test_message_ids"),
    pytest.mark.django_db(transaction=True),
]

# What the consumer's body did: (message id, the downstream key it sent).
RAN: list[tuple[str, str]] = []


@shared_task(base=ExactlyOnceTask, bind=True, name="tests.message_ids.settle")
def settle(self: ExactlyOnceTask, amount: int) -> None:
    RAN.append((self.request.id, derive_key("settle")))


@csrf_exempt
@idempotent(allow_anonymous=True)
def charge(request: HttpRequest) -> JsonResponse:
    amount = int(request.GET.get("amount", "100"))
    ids = [
        enqueue_task(settle, (amount,)),
        enqueue_event("charge.created", {"amount": amount}),
        emit_event("charge", "1", "created", {"amount": amount}),
    ]
    return JsonResponse({"ids": ids}, status=201)


urlpatterns = [path("charge/", charge)]


@pytest.fixture(autouse=True)
def clear() -> None:
    RAN.clear()


def post(key: str | None, amount: int = 100) -> list[str]:
    headers = {} if key is None else {"Idempotency-Key": key}
    response = Client().post(
        f"/charge/?amount={amount}", {}, content_type="application/json", headers=headers
    )
    assert response.status_code == 201, response.content
    ids: list[str] = response.json()["ids"]
    return ids


def lose_the_commit(key: str) -> None:
    """What a promoted replica that lacks the request's transaction holds: no record, no
    outbox row, no event; the consumer's own record (committed elsewhere) stays."""
    IdempotencyRecord.objects.filter(key=key).delete()
    OutboxMessage.objects.filter(name="tests.message_ids.settle").delete()
    OutboxMessage.objects.filter(name="charge.created").delete()
    OutboxEvent.objects.all().delete()


def deliver(message_id: str) -> None:
    """One delivery of the published task call, as the relay sends it."""
    row = OutboxMessage.objects.get(id=message_id)
    settle.apply(row.args, row.kwargs, task_id=message_id)


def test_a_run_after_a_lost_commit_publishes_the_same_ids_and_the_consumer_runs_once() -> None:
    key = str(uuid.uuid4())
    first = post(key)
    assert all(uuid.UUID(made).version == 8 for made in first) and len(set(first)) == 3
    assert {str(pk) for pk in OutboxEvent.objects.values_list("id", flat=True)} == {first[2]}
    # Their ids say no time: the rows' created_at keep the order the relay publishes them in.
    written = OutboxMessage.objects.order_by("created_at", "id").values_list("id", flat=True)
    assert [str(pk) for pk in written] == first[:2]
    deliver(first[0])

    lose_the_commit(key)
    again = post(key)
    assert again == first
    deliver(again[0])
    assert [message_id for message_id, _ in RAN] == [first[0]]

    # A consumer whose own record was lost too runs again, and sends the same downstream
    # key, which the provider deduplicates.
    IdempotencyRecord.objects.filter(key=first[0]).delete()
    deliver(again[0])
    assert len(RAN) == 2 and RAN[0] == RAN[1]


def test_another_request_key_or_generation_gives_other_ids() -> None:
    key = str(uuid.uuid4())
    first = post(key)
    lose_the_commit(key)
    other_body = post(key, amount=200)
    other_key = post(str(uuid.uuid4()))
    # The record expired but is still kept: the same request runs as the next generation.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE django_idempotency_record SET expires_at = now() - interval '1 second' "
            "WHERE key = %s",
            [key],
        )
    next_generation = post(key, amount=200)
    made = [*first, *other_body, *other_key, *next_generation]
    assert len(set(made)) == len(made)


def test_a_keyless_requests_ids_are_random() -> None:
    first, second = post(None), post(None)
    assert all(uuid.UUID(made).version == 7 for made in [*first, *second])
    assert not set(first) & set(second)
