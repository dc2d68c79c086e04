"""The payments API's OpenAPI schema (drf-spectacular): what its views really answer."""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse
from rest_framework.permissions import AllowAny, IsAuthenticated

OPEN_OR_AUTHENTICATED = (AllowAny, IsAuthenticated)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
DETAIL = OpenApiResponse(OpenApiTypes.OBJECT, description='`{"detail": ...}`')


class PaymentsSchema(AutoSchema):
    def _is_create_operation(self) -> bool:
        # Every POST of the payments API creates a payment or a receipt: 201.
        return self.method == "POST" or bool(super()._is_create_operation())

    def get_response_serializers(self) -> Any:
        answer = getattr(self.view, "answer_serializer_class", None)
        responses = super().get_response_serializers() if answer is None else answer
        if not isinstance(responses, dict):
            responses = {201 if self._is_create_operation() else 200: responses}
        if self.method in BODY_METHODS:
            responses.setdefault(
                400,
                OpenApiResponse(
                    OpenApiTypes.OBJECT,
                    description="The view's own validation errors: each field, its messages.",
                ),
            )
        if self.view.get_authenticators():
            responses.setdefault(401, DETAIL)
        if any(not isinstance(p, OPEN_OR_AUTHENTICATED) for p in self.view.get_permissions()):
            responses.setdefault(403, DETAIL)  # the charge's owner only
        if "{" in self.path:  # a path parameter: an object that may not exist
            responses.setdefault(404, DETAIL)
        return responses
