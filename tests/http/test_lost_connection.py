"""A view whose own database connection is lost while it runs (a cut, a restart, a
failover) answers 503 store-unavailable with Retry-After, never Django's plain 500: nothing
was saved, the key is free, and the retry runs once. A view's other database errors stay
its own 500. Through the DRF mixin, ``@idempotent`` (sync and async) and Ninja."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import IntegrityError, close_old_connections, connection
from django.http import HttpRequest, JsonResponse
from django.test import AsyncClient, Client
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from ninja import NinjaAPI
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from django_idempotency.ninja import idempotent_operation
from django_idempotency.rest_framework import IdempotencyMixin

pytestmark = [
    pytest.mark.urls("tests.http.test_lost_connection"),
    pytest.mark.django_db(transaction=True),
]

RUNS: list[str] = []


def run(request: Any) -> dict[str, str]:
    """The work: counted, then the connection cut (``?cut=1``) or a constraint broken."""
    RUNS.append(request.headers["Idempotency-Key"])
    with connection.cursor() as cursor:
        if request.GET.get("cut"):
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        if request.GET.get("broken"):
            raise IntegrityError("the view's own constraint")
    return {"ran": "yes"}


class View(IdempotencyMixin, APIView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []
    idempotency_allow_anonymous = True

    def post(self, request: Any) -> Response:
        return Response(run(request), status=201)


@csrf_exempt
@idempotent(allow_anonymous=True)
def plain(request: HttpRequest) -> JsonResponse:
    return JsonResponse(run(request), status=201)


@csrf_exempt
@idempotent(allow_anonymous=True)
async def plain_async(request: HttpRequest) -> JsonResponse:
    return JsonResponse(await sync_to_async(run)(request), status=201)


api = NinjaAPI(urls_namespace="lost-connection", docs_url=None)


@api.post("/ninja/")
@idempotent_operation(allow_anonymous=True)
def ninja(request: HttpRequest) -> Any:
    return run(request)  # 200, Ninja's default


urlpatterns = [
    path("drf/", View.as_view()),
    path("plain/", plain),
    path("async/", plain_async),
    path("", api.urls),
]
PATHS = ["/drf/", "/plain/", "/async/", "/ninja/"]


def post(path: str, key: str, query: str = "") -> Any:
    # As a server does after each request (the test client does not): a connection that
    # broke is closed, and the next request opens a new one.
    close_old_connections()
    client = AsyncClient if path == "/async/" else Client
    send = client(raise_request_exception=False).post
    if path == "/async/":
        send = async_to_sync(send)
    return send(path + query, {}, content_type="application/json", headers={"Idempotency-Key": key})


@pytest.mark.parametrize("path", PATHS)
def test_a_connection_lost_under_the_view_is_a_503_and_the_retry_runs_once(path: str) -> None:
    key = str(uuid.uuid4())
    RUNS.clear()

    cut = post(path, key, "?cut=1")

    assert cut.status_code == 503, cut.content
    assert cut.headers["Content-Type"] == "application/problem+json"
    assert cut.json()["type"].endswith("store-unavailable")
    assert cut.headers["Retry-After"] == "1"
    assert not IdempotencyRecord.objects.filter(key=key).exists()

    retry = post(path, key)
    assert retry.status_code == (200 if path == "/ninja/" else 201)
    assert "Idempotent-Replayed" not in retry.headers
    assert [key, key] == RUNS
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_the_views_other_database_errors_stay_its_own(path: str) -> None:
    key = str(uuid.uuid4())

    broken = post(path, key, "?broken=1")

    assert broken.status_code == 500
    assert broken.headers.get("Content-Type", "").startswith("text/html")
    assert not IdempotencyRecord.objects.filter(key=key).exists()
