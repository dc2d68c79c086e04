from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from adrf.views import APIView as AsyncAPIView
from asgiref.sync import iscoroutinefunction, sync_to_async
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db import router
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from django.views.defaults import page_not_found
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed, ValidationError
from rest_framework.generics import GenericAPIView, RetrieveUpdateAPIView
from rest_framework.permissions import AllowAny, BasePermission, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.rest_framework import IdempotencyMixin
from testproject.payments import chain, executions, receipts
from testproject.payments.faults import Faults, with_cookie
from testproject.payments.models import Charge, Payment
from testproject.payments.parsers import JSONParser
from testproject.payments.serializers import (
    ChargeDescriptionSerializer,
    ChargeSerializer,
    PaymentCountSerializer,
    PaymentSerializer,
    ReceiptAnswerSerializer,
    ReceiptSerializer,
    RefundSerializer,
)


def create_payment(
    serializer: PaymentSerializer,
    user: AbstractBaseUser | AnonymousUser,
    *,
    capture: bool = False,
) -> tuple[int, Any]:
    """The one payment handler behind every endpoint: count the run, validate, write;
    with ``capture`` (and a processor configured), capture it and post it to the ledger."""
    executions.record(serializer.Meta.model)
    faults = Faults.from_data(serializer.initial_data)
    serializer.is_valid(raise_exception=True)
    faults.before_write()
    # Captured before the write: without a key to derive the processor's key from, it
    # raises before anything is written.
    captured = chain.capture(serializer.validated_data) if capture else None
    payment = serializer.save(user=user)
    if captured is not None:
        chain.post_to_ledger(payment, captured, faults.ledger_switches)
    if faults.responds_with_error:
        return 500, {"detail": "fail=500r: answered 500 after writing"}
    faults.after_write()
    return 201, serializer.data if captured is None else {**serializer.data, "capture": captured}


class PaymentCreateView(GenericAPIView[Payment]):
    """Create a charge with no idempotency protection: the benchmark's baseline."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]
    parser_classes = [JSONParser]
    serializer_class: type[PaymentSerializer] = ChargeSerializer
    # Capture at the processor and post to the ledger (the protected charge view only).
    captures = False

    def post(self, request: Request) -> Response:
        serializer = self.get_serializer(data=request.data)
        assert isinstance(serializer, PaymentSerializer)
        status, body = create_payment(serializer, request.user, capture=self.captures)
        return with_cookie(Response(body, status=status), request.data)


class ChargeCreateView(IdempotencyMixin, PaymentCreateView):
    """Create a charge; a retry with the same ``Idempotency-Key`` gets the first answer."""

    captures = True
    # The version of its response body: a charge stored before a deploy that changes the
    # body (this string changes with it) is never replayed after it (docs/data-you-keep.md).
    idempotency_response_version = "2026-11"


class AsyncChargeCreateView(IdempotencyMixin, AsyncAPIView):
    """The charge handler as an async DRF view (adrf), protected by the same mixin."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]
    parser_classes = [JSONParser]
    # Read by drf-spectacular for the schema (APIView has no get_serializer).
    serializer_class = ChargeSerializer
    idempotency_required = True

    async def post(self, request: Request) -> Response:
        # DRF's serializers are sync; thread_sensitive (the default) runs them on the
        # request's one sync thread, so on the connection that holds the claim.
        status, body = await sync_to_async(create_payment)(
            ChargeSerializer(data=request.data), request.user
        )
        return with_cookie(Response(body, status=status), request.data)


class ReceiptPlainView(GenericAPIView[Charge]):
    """Create a charge and answer its receipt, ``size`` bytes of JSON, with no idempotency
    protection: the large-body benchmark's baseline."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]
    parser_classes = [JSONParser]
    serializer_class = ReceiptSerializer
    # Read by the schema (payments/schema.py): the answer is the receipt, not the charge.
    answer_serializer_class = ReceiptAnswerSerializer

    def post(self, request: Request) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        charge = serializer.save(user=request.user)
        size = serializer.validated_data["size"]
        return Response(receipts.receipt(serializer.data, charge.pk, size), status=201)


class ReceiptCreateView(IdempotencyMixin, ReceiptPlainView):
    """Create a charge and answer its receipt; a retry with the same ``Idempotency-Key``
    gets the same receipt, byte for byte."""


class IsOwner(BasePermission):
    """Only the charge's owner may change it."""

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return bool(obj.user_id == request.user.pk)


class ChargeDetailView(IdempotencyMixin, RetrieveUpdateAPIView[Charge]):
    """Read a charge, or change its description (``PATCH``, idempotent); owner only. A
    replay checks ownership again first."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated, IsOwner]
    parser_classes = [JSONParser]
    serializer_class = ChargeDescriptionSerializer
    queryset = Charge.objects.all()
    http_method_names = ["get", "patch", "head", "options"]


class RefundCreateView(IdempotencyMixin, PaymentCreateView):
    """Create a refund; a retry with the same ``Idempotency-Key`` gets the first answer."""

    serializer_class = RefundSerializer


class PaymentCountView(APIView):
    """How many times the handler ran (rollbacks included) and how many rows committed."""

    authentication_classes: list[type[Any]] = []
    permission_classes = [AllowAny]
    # Read by drf-spectacular for the response schema (APIView has no get_serializer).
    serializer_class = PaymentCountSerializer
    model: type[Payment] = Charge

    def get(self, request: Request) -> Response:
        return Response(
            {
                "executions": executions.count(self.model),
                "rows": self.model._default_manager.count(),
            }
        )


def authenticate(request: HttpRequest) -> HttpResponse | None:
    """DRF's token authentication: set ``request.user``, or return the 401 to send."""
    try:
        authenticated = TokenAuthentication().authenticate(request)  # type: ignore[arg-type]
    except AuthenticationFailed:
        authenticated = None
    if authenticated is None:
        return JsonResponse(
            {"detail": "Send 'Authorization: Token <key>'."},
            status=401,
            headers={"WWW-Authenticate": "Token"},
        )
    request.user = authenticated[0]
    return None


def token_required(view: Callable[..., Any]) -> Callable[..., Any]:
    """Token authentication for a plain Django view, sync or async."""
    if iscoroutinefunction(view):

        @wraps(view)
        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            refused = await sync_to_async(authenticate)(request)
            return refused or await view(request, *args, **kwargs)

        return async_wrapper

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return authenticate(request) or view(request, *args, **kwargs)

    return wrapper


def json_body(view: Callable[..., Any]) -> Callable[..., Any]:
    """Answer 415 to a body that is not JSON before anything reads it: the plain views parse
    JSON only, and ``@idempotent`` below would otherwise read (and fingerprint) a multipart
    upload of any size first."""

    def refused(request: HttpRequest) -> HttpResponse | None:
        meta = request.META
        empty = (
            meta.get("CONTENT_LENGTH") in (None, "", "0") and "HTTP_TRANSFER_ENCODING" not in meta
        )
        if request.content_type == "application/json" or empty:
            return None
        return JsonResponse({"detail": "The body must be application/json."}, status=415)

    if iscoroutinefunction(view):

        @wraps(view)
        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            return refused(request) or await view(request, *args, **kwargs)

        return async_wrapper

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return refused(request) or view(request, *args, **kwargs)

    return wrapper


def charges_database(request: HttpRequest) -> str:
    """Where the plain views write charges (a tenant router picks it per request): their
    records must live there too, to commit with the charge."""
    return router.db_for_write(Charge)


# Authentication wraps @idempotent so that the principal is known and a replay never
# bypasses it, and so does the media type check; csrf_exempt because, like DRF's views,
# this API authenticates by token.
@csrf_exempt
@require_POST
@token_required
@json_body
@idempotent(required=True, using=charges_database)
def charge_without_drf(request: HttpRequest) -> HttpResponse:
    """The charge handler as a plain Django view, protected by ``@idempotent``."""
    try:
        data = json.loads(request.body)
    except (ValueError, RecursionError):
        return JsonResponse({"detail": "The body must be JSON."}, status=400)
    try:
        status, body = create_payment(ChargeSerializer(data=data), request.user)
    except ValidationError as exc:
        return JsonResponse(exc.detail, status=400, safe=False)
    return with_cookie(JsonResponse(body, status=status), data)


@csrf_exempt
@require_POST
@token_required
@json_body
@idempotent(required=True, using=charges_database)
async def charge_async(request: HttpRequest) -> HttpResponse:
    """The charge handler as an async Django view, protected by ``@idempotent``."""
    try:
        data = json.loads(request.body)
    except (ValueError, RecursionError):
        return JsonResponse({"detail": "The body must be JSON."}, status=400)
    try:
        # DRF's serializers are sync; thread_sensitive (the default) runs them on the
        # request's one sync thread, so on the connection that holds the claim.
        status, body = await sync_to_async(create_payment)(
            ChargeSerializer(data=data), request.user
        )
    except ValidationError as exc:
        return JsonResponse(exc.detail, status=400, safe=False)
    return JsonResponse(body, status=status)


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """404 for a URL without a route: JSON under /api/, Django's page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return page_not_found(request, exception)
