"""Downstream keys: ``derive_key(step)`` inside a protected view, from outside over HTTP (the
test client), including a request re-executed after a rollback."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.test import AsyncClient, Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.messaging.downstream import OutsideUnitOfWork, derive_key
from django_idempotency.models import IdempotencyRecord
from django_idempotency.rest_framework import IdempotencyMixin
from django_idempotency.storage import secret

pytestmark = [
    pytest.mark.urls("tests.messaging.test_downstream"),
    pytest.mark.django_db(transaction=True),
]

# Every key a view derived, rolled back runs included.
SENT: list[str] = []


def tenant(request: HttpRequest) -> str:
    return request.headers.get("X-Tenant", "a")


@csrf_exempt
@idempotent(principal=tenant)
def charge(request: HttpRequest) -> JsonResponse:
    key = derive_key(request.GET.get("step", "capture"))
    SENT.append(key)
    # A header, which the fingerprint leaves out: the retry is the same request.
    if request.headers.get("X-Fail"):
        raise RuntimeError("failed after calling the processor")
    return JsonResponse({"key": key}, status=201)


@csrf_exempt
@idempotent(allow_anonymous=True)
async def charge_async(request: HttpRequest) -> JsonResponse:
    key = derive_key("capture")
    # Also from the sync thread that holds the claim.
    same = await sync_to_async(derive_key)("capture")
    return JsonResponse({"key": key, "same": same == key}, status=201)


class ChargeView(IdempotencyMixin, APIView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []
    idempotency_allow_anonymous = True

    def post(self, request: Any) -> Response:
        return Response({"key": derive_key("capture")}, status=201)


@csrf_exempt
def unprotected(request: HttpRequest) -> JsonResponse:
    try:
        derive_key("capture")
    except OutsideUnitOfWork as exc:
        return JsonResponse({"error": str(exc)}, status=500)
    return JsonResponse({}, status=201)  # pragma: no cover


urlpatterns = [
    path("charge/", charge),
    path("charge-async/", charge_async),
    path("charge-drf/", ChargeView.as_view()),
    path("unprotected/", unprotected),
]


@pytest.fixture(autouse=True)
def clear() -> None:
    SENT.clear()


def post(path: str, key: str, **headers: str) -> Any:
    client = Client(raise_request_exception=False)
    return client.post(path, {}, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key,
                       headers=headers)  # fmt: skip


def test_a_request_re_executed_after_a_rollback_sends_the_same_downstream_key() -> None:
    key = str(uuid.uuid4())
    assert post("/charge/", key, **{"X-Fail": "1"}).status_code == 500
    response = post("/charge/", key)
    assert response.status_code == 201
    assert SENT[0] == SENT[1] == response.json()["key"]
    # The stored answer is replayed, so the processor is not even called a third time.
    assert post("/charge/", key).json()["key"] == SENT[0] and len(SENT) == 2


def test_other_keys_principals_and_steps_give_other_downstream_keys() -> None:
    key = str(uuid.uuid4())
    base = post("/charge/", key).json()["key"]
    others = {
        post("/charge/", str(uuid.uuid4())).json()["key"],
        post("/charge/", key, **{"X-Tenant": "b"}).json()["key"],
        post("/charge/?step=refund", str(uuid.uuid4())).json()["key"],
    }
    assert base not in others and len(others) == 3


def test_a_key_that_runs_anew_as_its_next_generation_sends_another_downstream_key() -> None:
    key = str(uuid.uuid4())
    first = post("/charge/", key).json()["key"]
    # Expired but still kept: the same request on the same key is a new operation.
    IdempotencyRecord.objects.filter(key=key).update(expires_at="2000-01-01T00:00:00Z")
    again = post("/charge/", key)
    assert again.status_code == 201 and again.json()["key"] != first


def test_the_key_is_uuid_shaped_and_reveals_nothing_of_its_inputs() -> None:
    key = "order-42-capture"
    derived = post("/charge/", key).json()["key"]
    parsed = uuid.UUID(derived)
    assert parsed.version == 8 and parsed.variant == uuid.RFC_4122
    assert key not in derived
    assert "capture" not in derived and "str:a" not in derived


def test_the_key_depends_on_the_apps_secret() -> None:
    # The same request (principal, key and step) under two secrets of the database. Its
    # record is erased in between, so that the second runs instead of replaying the first's.
    first = post("/charge/", "k-1").json()["key"]
    IdempotencyRecord.objects.filter(key="k-1").delete()
    made = secret.shared_secret("default")
    try:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE django_idempotency_secret SET secret = 'another secret'")
        secret.forget()
        second = post("/charge/", "k-1").json()["key"]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE django_idempotency_secret SET secret = %s", [made])
        secret.forget()
    assert [first, second] == SENT  # the second ran: no replay
    assert second != first


def post_json(path: str, key: str, body: dict[str, Any], **headers: str) -> Any:
    client = Client(raise_request_exception=False)
    return client.post(path, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key,
                       headers=headers)  # fmt: skip


def test_another_request_on_the_same_key_after_a_rollback_sends_another_downstream_key() -> None:
    key = str(uuid.uuid4())
    failed = post_json("/charge/", key, {"amount": 2499}, **{"X-Fail": "1"})
    assert failed.status_code == 500
    other = post_json("/charge/", key, {"amount": 1000})
    assert other.status_code == 201
    # A provider that deduplicates on the key alone would have answered the 1000 with the
    # 2499's result.
    assert SENT[0] != SENT[1] == other.json()["key"]
    # Its own retry is the same request: the stored answer.
    assert post_json("/charge/", key, {"amount": 1000}).json()["key"] == SENT[1]


def test_the_key_depends_on_the_apps_secret_and_not_on_secret_key() -> None:
    key = str(uuid.uuid4())
    with override_settings(SECRET_KEY="one server's SECRET_KEY"):
        assert post("/charge/", key, **{"X-Fail": "1"}).status_code == 500
    # The retry lands on a server with another SECRET_KEY: the same downstream key.
    with override_settings(SECRET_KEY="another server's SECRET_KEY"):
        assert post("/charge/", key, **{"X-Fail": "1"}).status_code == 500
    # A server set with a secret of its own is refused before the view: it never sends a
    # key of its own downstream.
    with override_settings(IDEMPOTENCY_SECRET_KEY="a secret of the project's own"):
        refused = post("/charge/", key)
        assert refused.status_code == 500 and refused.json()["type"].endswith("misconfigured")
    # Set with the database's own secret, it derives the key every other server does.
    with override_settings(IDEMPOTENCY_SECRET_KEY=secret.shared_secret("default")):
        assert post("/charge/", key).status_code == 201
    assert len(SENT) == 3 and SENT[0] == SENT[1] == SENT[2]


def test_the_drf_mixin_derives_keys_too() -> None:
    key = str(uuid.uuid4())
    drf = post("/charge-drf/", key).json()["key"]
    assert uuid.UUID(drf).version == 8


def test_an_async_view_derives_the_same_key_on_both_sides() -> None:
    client = AsyncClient()
    response = async_to_sync(client.post)(
        "/charge-async/", {}, content_type="application/json", headers={"Idempotency-Key": "k-a"}
    )
    assert response.status_code == 201 and response.json()["same"] is True


def test_outside_a_unit_of_work_derive_key_refuses_with_a_clear_error() -> None:
    response = Client().post("/unprotected/")
    assert "derive_key() derives from the key of the work running now" in response.json()["error"]
    # A view protected by @idempotent but called without a key runs unprotected too.
    response = Client(raise_request_exception=False).post("/charge/")
    assert response.status_code == 500 and SENT == []
    with pytest.raises(ValueError, match="step"):
        derive_key("")
