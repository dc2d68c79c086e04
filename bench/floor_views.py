"""The floor views of ``bench/floor.py``, and the benchmark's URLs: those and the
testproject's."""

from __future__ import annotations

from django.db import connection, transaction
from django.http import HttpResponse
from django.urls import include, path
from rest_framework.authentication import TokenAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from bench.floor import FLOOR_CANNED, FLOOR_FRESH, FLOOR_REPLAY, PATHS
from testproject.payments.parsers import JSONParser
from testproject.payments.views import PaymentCreateView

# A charge as the protected endpoint stores it, answered as stored bytes.
STORED = (
    b'{"id":40651,"amount":2499,"currency":"inr","user":"alice",'
    b'"created":"2026-11-24T04:59:00.200405Z","description":""}'
)


class FreshFloorView(PaymentCreateView):
    def post(self, request: Request) -> Response:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 'claim'")
            response = super().post(request)
            # Rendered before the commit, as the engine renders before it stores.
            response.accepted_renderer = request.accepted_renderer
            response.accepted_media_type = request.accepted_media_type
            response.renderer_context = self.get_renderer_context()
            response.render()
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


urlpatterns = [
    path(PATHS[FLOOR_FRESH].lstrip("/"), FreshFloorView.as_view()),
    path(PATHS[FLOOR_REPLAY].lstrip("/"), ReplayFloorView.as_view()),
    path(PATHS[FLOOR_CANNED].lstrip("/"), ReplayFloorView.as_view(opens_transaction=False)),
    path("", include("testproject.urls")),
]
