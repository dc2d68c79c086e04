"""The floor views of ``bench/floor.py``, and the benchmark's URLs: those, the charges with
``lookup_first`` on, and the testproject's."""

from __future__ import annotations

from datetime import timedelta

from django.db import DEFAULT_DB_ALIAS, connection, transaction
from django.http import HttpResponse
from django.urls import include, path
from rest_framework.authentication import TokenAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from bench.floor import (
    FLOOR_CANNED,
    FLOOR_FRESH,
    FLOOR_FRESH_STATEMENTS,
    FLOOR_REPLAY,
    FLOOR_REPLAY_STATEMENTS,
    LOOKUP_FIRST_PATH,
    PATHS,
)
from django_idempotency.conf import conf
from django_idempotency.engine.hashing import lock_id
from django_idempotency.engine.work import Replay
from django_idempotency.http.request import replay_response
from django_idempotency.storage import bodies
from django_idempotency.storage import records as storage
from testproject.payments.parsers import JSONParser
from testproject.payments.views import ChargeCreateView, PaymentCreateView

# A charge as the protected endpoint stores it, answered as stored bytes.
STORED = (
    b'{"id":40651,"amount":2499,"currency":"inr","user":"alice",'
    b'"created":"2026-11-24T04:59:00.200405Z","description":""}'
)


class FreshFloorView(PaymentCreateView):
    def charge(self, request: Request) -> Response:
        """The plain charge, rendered: as the engine renders before it stores."""
        response = super().post(request)
        response.accepted_renderer = request.accepted_renderer
        response.accepted_media_type = request.accepted_media_type
        response.renderer_context = self.get_renderer_context()  # type: ignore[attr-defined]
        response.render()
        return response

    def post(self, request: Request) -> Response:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 'claim'")
            response = self.charge(request)
            # psycopg's commit() then sends nothing: the server is already idle.
            cursor.execute("SELECT 'store'; COMMIT")
        return response


class ReplayFloorView(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]
    parser_classes = [JSONParser]
    # With the three round trips of a replay's transaction, or without.
    opens_transaction = True

    def post(self, request: Request) -> HttpResponse:
        if self.opens_transaction:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT 'claim'")
        response = HttpResponse(STORED, status=201, content_type="application/json")
        response["Vary"] = "Accept"
        return response


# What the engine would have stored as the request's fingerprint: the floor computes none.
FINGERPRINT = {"method": "POST", "path": "/api/charges/", "body": "0" * 64}
KEPT_HEADERS = ("Content-Type", "Vary", "Allow")


def claim_key(principal: str, key: str) -> storage.Claimed:
    """The real claim of (principal, key), as the engine sends it for a request that does
    not wait, inside the caller's transaction."""
    return storage.claim(
        DEFAULT_DB_ALIAS,
        lock=lock_id(DEFAULT_DB_ALIAS, principal, key),
        principal=principal,
        key=key,
        window=conf.MAX_TTL + conf.EXPIRED_WINDOW,
        gone=conf.EXPIRED_WINDOW,
        wait=timedelta(0),
    )


def claim(request: Request) -> tuple[str, str, storage.Claimed]:
    """The claim of the request's key: (principal, key, what it found)."""
    principal, key = f"user:{request.user.pk}", request.headers["idempotency-key"]
    return principal, key, claim_key(principal, key)


def finished(
    principal: str,
    key: str,
    claimed: storage.Claimed,
    *,
    path: str,
    code: int,
    headers: list[list[str]],
    body: bytes,
    encoding: str,
) -> storage.Finished:
    """A record to store as the engine writes one, with a constant fingerprint."""
    assert claimed.created_at is not None  # the claim was won
    return storage.Finished(
        principal=principal,
        key=key,
        method="POST",
        path=path,
        fingerprint=FINGERPRINT,
        created_at=claimed.created_at,
        expires_at=claimed.created_at + conf.TTL,
        code=code,
        headers=headers,
        body=body,
        body_encoding=encoding,
    )


class FreshStatementsFloorView(FreshFloorView):
    def post(self, request: Request) -> Response:
        with transaction.atomic():
            principal, key, claimed = claim(request)
            if claimed.created_at is None:
                return Response({"claimed": claimed.outcome.value}, status=409)
            response = self.charge(request)
            body, encoding = bodies.encode_body(
                DEFAULT_DB_ALIAS, response.content, conf.COMPRESS_MIN_BYTES
            )
            record = finished(
                principal,
                key,
                claimed,
                path=request.path,
                code=response.status_code,
                headers=[[n, v] for n, v in response.items() if n in KEPT_HEADERS],
                body=body,
                encoding=encoding,
            )
            storage.store(DEFAULT_DB_ALIAS, record, row_id=None, commit=True)
        return response


class ReplayStatementsFloorView(ReplayFloorView):
    def post(self, request: Request) -> HttpResponse:
        with transaction.atomic():
            _, _, claimed = claim(request)
        if claimed.record is None:
            return HttpResponse(status=409)
        # The stored response as every replay builds it, with no decision about it.
        return replay_response(Replay.of(claimed.record), False, {})


def _route(url: str) -> str:
    return url.removeprefix("/bench/")


bench_patterns = [
    path(_route(PATHS[FLOOR_FRESH]), FreshFloorView.as_view()),
    path(_route(PATHS[FLOOR_REPLAY]), ReplayFloorView.as_view()),
    path(_route(PATHS[FLOOR_CANNED]), ReplayFloorView.as_view(opens_transaction=False)),
    path(_route(PATHS[FLOOR_FRESH_STATEMENTS]), FreshStatementsFloorView.as_view()),
    path(_route(PATHS[FLOOR_REPLAY_STATEMENTS]), ReplayStatementsFloorView.as_view()),
    path(_route(LOOKUP_FIRST_PATH), ChargeCreateView.as_view(idempotency_lookup_first=True)),
]
# The benchmark's views nested as deep as the testproject's charges (in the bench/ prefix,
# which the charges' paths leave at once), so that both resolve alike: at the top level, a
# floor resolved about 40 us faster than a charge (measured in-process).
urlpatterns = [
    path("", include([path("bench/", include(bench_patterns))])),
    path("", include("testproject.urls")),
]
