"""drf-spectacular: views using ``IdempotencyMixin`` document the key header and the errors the
app may answer; ``AppConfig.ready()`` imports this module, which registers the extension."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse
from rest_framework import serializers
from rest_framework.views import APIView

from django_idempotency.conf import conf
from django_idempotency.engine.errors import (
    RETRY_AFTER_SECONDS,
    IdempotencyError,
    InProgress,
    StoreUnavailable,
)
from django_idempotency.engine.work import PARTS
from django_idempotency.http.identity import KEY_PATTERN, MAX_KEY_LENGTH
from django_idempotency.http.options import Policy
from django_idempotency.http.problems import PROBLEM_CONTENT_TYPE, possible_errors, status_for
from django_idempotency.http.request import REPLAYED_HEADER

if TYPE_CHECKING:
    _Serializer = serializers.Serializer[Any]
else:  # generic in the stubs; DRF's own may stop taking a subscript at run time
    _Serializer = serializers.Serializer


class IdempotencyProblemSerializer(_Serializer):
    """An RFC 9457 problem: what django-idempotency answers instead of running the view."""

    type = serializers.CharField(help_text="A URI naming the problem type.")
    title = serializers.CharField()
    status = serializers.IntegerField()
    detail = serializers.CharField()
    differing = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        help_text=(
            "key-reused only: the parts of the request that differ from the first one with "
            f"this key ({', '.join(PARTS)} or header:<name>)."
        ),
    )


class IdempotencyStripeErrorDetailSerializer(_Serializer):
    type = serializers.CharField()
    message = serializers.CharField()
    code = serializers.CharField(required=False)
    differing = serializers.ListField(child=serializers.CharField(), required=False)


class IdempotencyStripeErrorSerializer(_Serializer):
    """Stripe's error object, answered when ``IDEMPOTENCY_ERROR_FORMAT = "stripe"``."""

    error = IdempotencyStripeErrorDetailSerializer()


# Answered with Retry-After.
RETRIED_ERRORS = (InProgress, StoreUnavailable)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# A DRF view answers its serializer's errors with 400 too, in its own JSON.
VIEW_VALIDATION_ERRORS = OpenApiResponse(
    OpenApiTypes.OBJECT,
    description="The view's own validation errors (its serializer's), in the view's format.",
)
# Not a key: a copy-pasted example must be refused (400 invalid-key), never replayed.
KEY_EXAMPLE = "<a new UUID for each operation>"


def error_responses(errors: list[type[IdempotencyError]]) -> dict[tuple[int, str], OpenApiResponse]:
    """One documented response per status code, in the configured error format."""
    stripe = conf.ERROR_FORMAT == "stripe"
    by_status: dict[int, list[type[IdempotencyError]]] = {}
    for error in errors:
        by_status.setdefault(status_for(error), []).append(error)
    media_type = "application/json" if stripe else PROBLEM_CONTENT_TYPE
    responses = {}
    if own_envelope():
        # The project's function or EXCEPTION_HANDLER shapes the body: its statuses are known,
        # its schema is not.
        for status, group in sorted(by_status.items()):
            responses[status, "application/json"] = OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="; ".join(f"{error.name}: {error.title}" for error in group),
            )
        return responses
    for status, group in sorted(by_status.items()):
        examples = []
        for error in group:
            if stripe:
                detail = {"type": error.stripe_type, "message": error.title}
                value: dict[str, Any] = {
                    "error": {**detail, "code": error.stripe_code} if error.stripe_code else detail
                }
            else:
                value = {
                    "type": conf.PROBLEM_TYPE_BASE + error.name,
                    "title": error.title,
                    "status": status,
                    "detail": error.title + ".",
                }
            examples.append(
                OpenApiExample(
                    error.name,
                    value=value,
                    media_type=media_type,
                    status_codes=[status],
                    response_only=True,
                )
            )
        responses[status, media_type] = OpenApiResponse(
            IdempotencyStripeErrorSerializer if stripe else IdempotencyProblemSerializer,
            description="; ".join(f"{error.name}: {error.title}" for error in group),
            examples=examples,
        )
    return responses


def own_envelope() -> bool:
    """Whether errors go out in the project's own envelope (IDEMPOTENCY_ERROR_FORMAT a
    function, or IDEMPOTENCY_DRF_EXCEPTION_HANDLER on), not in a shape the package knows."""
    return callable(conf.ERROR_FORMAT) or conf.DRF_EXCEPTION_HANDLER


def _code(key: Any) -> str:
    return str(key[0] if isinstance(key, tuple) else key)


class IdempotencySchemaMixin:
    """Adds the key header, the replay and retry headers and the error responses to the
    operations the view makes idempotent."""

    method: str
    view: Any

    def idempotency_options(self) -> Policy | None:
        options: Policy = self.view.get_idempotency_policy()
        return options if self.method.upper() in options.methods else None

    def own_responses(self) -> dict[Any, Any]:
        """The view's own responses by code, as drf-spectacular would document them."""
        responses = super().get_response_serializers()  # type: ignore[misc]
        if isinstance(responses, dict):
            return dict(responses)
        if self.method.upper() == "DELETE":
            return {204: None}
        created = self._is_create_operation()  # type: ignore[attr-defined]
        return {201 if created else 200: responses}

    def get_override_parameters(self) -> list[Any]:
        parameters: list[Any] = super().get_override_parameters()  # type: ignore[misc]
        options = self.idempotency_options()
        if options is None:
            return parameters
        retry_codes = sorted({status_for(error) for error in RETRIED_ERRORS})
        # A key read by key_from is no parameter of the request's.
        header = [] if options.key_from else [self._key_parameter(options)]
        return [
            *parameters,
            *header,
            OpenApiParameter(
                REPLAYED_HEADER,
                type={"type": "string", "enum": ["true"]},
                location=OpenApiParameter.HEADER,
                # Any response of the view's own may be a replay; our errors never are.
                response=sorted({_code(key) for key in self.own_responses()}),
                description="`true` when this is the stored response of an earlier request "
                "with the same key, replayed.",
            ),
            OpenApiParameter(
                "Retry-After",
                type={"type": "integer", "minimum": RETRY_AFTER_SECONDS},
                location=OpenApiParameter.HEADER,
                response=retry_codes,
                description="Seconds to wait before retrying with the same key.",
            ),
        ]

    def _key_parameter(self, options: Policy) -> Any:
        return OpenApiParameter(
            options.header,  # a webhook receiver's key_header, else IDEMPOTENCY_HEADER
            type={"type": "string", "pattern": KEY_PATTERN},
            location=OpenApiParameter.HEADER,
            required=options.required,
            description=(
                "Makes this request safe to retry: the first request with a key runs, "
                "a retry with the same key and the same request gets the first response "
                f"back. 1 to {MAX_KEY_LENGTH} printable ASCII characters other than space, "
                '`"`, `,`, `;` and `\\`, bare or as a structured-field string (with '
                "parameters). Make a new one, such as a UUID, for each operation, and send "
                "it again only on that operation's retries."
            ),
            examples=[OpenApiExample("a new key for each operation", value=KEY_EXAMPLE)],
        )

    def get_response_serializers(self) -> Any:
        options = self.idempotency_options()
        if options is None:
            return super().get_response_serializers()  # type: ignore[misc]
        responses = self.own_responses()
        documented = {_code(key) for key in responses}
        # Stripe's and the project's own bodies share the view's media type: its own one wins.
        stripe = conf.ERROR_FORMAT == "stripe" or own_envelope()
        for key, response in error_responses(possible_errors(options)).items():
            # A problem+json body can sit beside the view's own body for the same code; a
            # Stripe error body shares its media type, so the view's own one wins.
            if not (stripe and _code(key) in documented):
                responses[key] = response
        if not stripe and self.method.upper() in BODY_METHODS and "400" not in documented:
            responses[400, "application/json"] = VIEW_VALIDATION_ERRORS
        return responses


class IdempotencyViewExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Swaps each idempotent view, for schema generation only, for a subclass whose
    handlers carry a schema class with ``IdempotencySchemaMixin`` on top.

    On top, because a schema made by ``@extend_schema`` answers the responses and
    parameters it was given without asking its base classes. Per handler, because that is
    where drf-spectacular looks first for a schema (the ``kwargs`` that ``@action`` and
    ``@extend_schema`` set), before the view's own.
    """

    target_class = "django_idempotency.rest_framework.IdempotencyMixin"
    match_subclasses = True

    def view_replacement(self) -> type[APIView]:
        view_class: type[APIView] = self.target
        view_schema = view_class.schema
        if not isinstance(view_schema, AutoSchema):
            return view_class  # excluded (schema = None), or not drf-spectacular's
        actions = getattr(self.target_callback, "actions", None)
        names = set(actions.values()) if actions else set(view_class.http_method_names)
        namespace: dict[str, Any] = {
            # drf-spectacular derives descriptions and warnings from these.
            "__module__": view_class.__module__,
            "__qualname__": view_class.__qualname__,
            "__doc__": view_class.__doc__,
        }
        for name in names:
            handler = getattr(view_class, name, None)
            if handler is not None:
                namespace[name] = _with_schema(handler, type(view_schema))
        return type(view_class.__name__, (view_class,), namespace)


def _with_schema(handler: Any, view_schema: type[AutoSchema]) -> Any:
    base = getattr(handler, "kwargs", {}).get("schema") or view_schema
    schema = type(base.__name__, (IdempotencySchemaMixin, base), {})

    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return handler(*args, **kwargs)

    # A new dict: wraps() shares the handler's own, which must stay as it is.
    wrapper.kwargs = {**getattr(handler, "kwargs", {}), "schema": schema}  # type: ignore[attr-defined]
    return wrapper
