"""``OutboxTask``: existing ``.delay()`` calls moved onto the outbox without editing them.
Inside a protected view the call is a row of the request's transaction; outside one it goes
to the broker at once, as before."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest
from celery import Task
from django.http import HttpRequest, JsonResponse
from django.test import Client
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.decorators import idempotent
from django_idempotency.messaging.outbox import OutboxError
from django_idempotency.messaging.outbox.celery import OutboxTask
from django_idempotency.models import OutboxMessage
from testproject.celery import app

pytestmark = [
    pytest.mark.urls("tests.messaging.test_outbox_task"),
    pytest.mark.django_db(transaction=True),
]


@app.task(name="tests.outbox_task.notify", base=OutboxTask, shared=False)
def notify(charge: int, *, note: str = "") -> str:
    return f"{charge}:{note}"


@csrf_exempt
@idempotent(allow_anonymous=True)
def charge(request: HttpRequest) -> JsonResponse:
    options = {"countdown": 30} if request.GET.get("later") else {}
    if request.GET.get("link"):
        options = {"link": notify.s(0)}
    result = notify.apply_async((42,), {"note": "paid"}, **options)
    if request.GET.get("fail"):
        raise RuntimeError("the charge failed after its task was sent")
    return JsonResponse({"task_id": result.id}, status=201)


urlpatterns = [path("charge/", charge)]


def post(client: Client, query: str = "", key: str | None = None) -> Any:
    return client.post(f"/charge/{query}", headers={"Idempotency-Key": key or str(uuid.uuid4())})


@pytest.fixture
def broker_calls() -> Any:
    with mock.patch.object(Task, "apply_async", autospec=True) as sent:
        yield sent


def test_inside_a_protected_view_delay_is_an_outbox_row_with_its_task_id(
    client: Client, broker_calls: Any
) -> None:
    response = post(client)

    (row,) = OutboxMessage.objects.all()
    assert response.status_code == 201
    assert response.json()["task_id"] == str(row.id)
    assert (row.name, row.args, row.kwargs) == ("tests.outbox_task.notify", [42], {"note": "paid"})
    broker_calls.assert_not_called()


def test_a_rolled_back_request_sends_nothing(client: Client, broker_calls: Any) -> None:
    with pytest.raises(RuntimeError):
        post(client, "?fail=1")

    assert not OutboxMessage.objects.exists()
    broker_calls.assert_not_called()


def test_a_replay_enqueues_nothing_again(client: Client, broker_calls: Any) -> None:
    key = str(uuid.uuid4())
    first, retry = post(client, key=key), post(client, key=key)

    assert retry.headers["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert OutboxMessage.objects.count() == 1


def test_countdown_and_eta_are_kept(client: Client, broker_calls: Any) -> None:
    post(client, "?later=1")
    (row,) = OutboxMessage.objects.all()
    assert row.options == {"countdown": 30.0}

    from django_idempotency.messaging.outbox.celery import _countdown

    in_a_minute = datetime.now(UTC) + timedelta(minutes=1)
    assert 55 < (_countdown(None, in_a_minute) or 0) <= 60
    with pytest.raises(OutboxError, match="countdown or eta"):
        _countdown(5, in_a_minute)


def test_an_option_the_outbox_cannot_keep_is_refused_by_name(client: Client) -> None:
    with pytest.raises(OutboxError, match="not link"):
        post(client, "?link=1")
    assert not OutboxMessage.objects.exists()


def test_outside_a_unit_of_work_delay_goes_to_the_broker_as_before(broker_calls: Any) -> None:
    notify.delay(7, note="now")

    assert not OutboxMessage.objects.exists()
    (call,) = broker_calls.call_args_list
    assert call.args[1:3] == ((7,), {"note": "now"})


def test_a_keyless_request_to_a_protected_view_sends_delay_through_the_outbox_too(
    client: Client, broker_calls: Any
) -> None:
    answered = client.post("/charge/")
    (row,) = OutboxMessage.objects.all()
    assert answered.status_code == 201 and answered.json()["task_id"] == str(row.id)
    broker_calls.assert_not_called()
    with pytest.raises(RuntimeError):
        client.post("/charge/?fail=1")
    assert OutboxMessage.objects.count() == 1
    broker_calls.assert_not_called()
