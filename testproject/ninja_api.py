"""The payments API's charge endpoint again, as a Django Ninja operation protected by
``idempotent_operation``, with the same DRF tokens for authentication."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.responses import Status
from ninja.security import APIKeyHeader
from pydantic import BaseModel, ConfigDict, Field
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed, ValidationError

from django_idempotency.ninja import idempotent_operation
from testproject.payments.serializers import ChargeSerializer
from testproject.payments.views import create_payment


class DRFToken(APIKeyHeader):
    """``Authorization: Token <key>``, checked by DRF's ``TokenAuthentication``; the
    operation's ``request.auth`` is the token's user."""

    param_name = "Authorization"

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        try:
            found = TokenAuthentication().authenticate(request)  # type: ignore[arg-type]
        except AuthenticationFailed:
            return None
        return found[0] if found else None


api = NinjaAPI(urls_namespace="ninja", auth=DRFToken(), docs_url=None)


@api.exception_handler(ValidationError)
def serializer_errors(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    return api.create_response(request, exc.detail, status=400)


class ChargeIn(BaseModel):
    # Ninja validates these (a 422 of its own); the payments serializer validates them again
    # and reads the fault switches from the extra fields (which ninja.Schema would drop).
    model_config = ConfigDict(extra="allow")

    amount: int = Field(gt=0)
    currency: str
    description: str = ""


# The statuses the payments handler answers with (Ninja renders only declared ones).
CHARGED = {201: dict[str, Any], 500: dict[str, Any]}


@api.post("/charges/", response=CHARGED)
@idempotent_operation(required=True)
def charge(request: HttpRequest, payload: ChargeIn) -> Status[Any]:
    """Create a charge; a retry with the same ``Idempotency-Key`` gets the first answer."""
    serializer = ChargeSerializer(data=payload.model_dump())
    status, body = create_payment(serializer, request.auth)  # type: ignore[attr-defined]
    return Status(status, body)


@api.post("/charges/async/", response=CHARGED)
@idempotent_operation(required=True)
async def charge_async(request: HttpRequest, payload: ChargeIn) -> Status[Any]:
    """The same, as an async operation."""
    serializer = ChargeSerializer(data=payload.model_dump())
    # DRF's serializers are sync; thread_sensitive (the default) runs them on the request's
    # one sync thread, so on the connection that holds the claim.
    status, body = await sync_to_async(create_payment)(serializer, request.auth)  # type: ignore[attr-defined]
    return Status(status, body)
