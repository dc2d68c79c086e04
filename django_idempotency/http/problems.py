"""Turn engine errors into HTTP responses: RFC 9457 problem+json, or Stripe's error object."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from django.http import HttpResponse
from django.http.response import HttpResponseBase

from django_idempotency.conf import conf
from django_idempotency.engine.errors import (
    IdempotencyError,
    InProgress,
    InvalidKey,
    KeyExpired,
    KeyReused,
    MissingKey,
    StoreUnavailable,
    VersionChanged,
)
from django_idempotency.http.options import Policy

PROBLEM_CONTENT_TYPE = "application/problem+json"
# IDEMPOTENCY_ERROR_FORMAT: RFC 9457 problems, or Stripe's error object.
ERROR_FORMATS = ("problem", "stripe")
R = TypeVar("R", bound=HttpResponseBase)


def status_for(error: IdempotencyError | type[IdempotencyError]) -> int:
    """The status ``error`` is answered with, in the configured error format."""
    return error.stripe_status if conf.ERROR_FORMAT == "stripe" else error.status


def problem_response(exc: IdempotencyError) -> HttpResponse:
    body: Any
    status = status_for(exc)
    error_format = conf.ERROR_FORMAT
    if callable(error_format):
        # The project's own envelope: it shapes the body, the status and headers stay ours.
        body, content_type = error_format(exc), "application/json"
    elif error_format == "stripe":
        error = {"type": exc.stripe_type, "message": exc.detail, **exc.extra}
        if exc.stripe_code:
            error["code"] = exc.stripe_code
        body, content_type = {"error": error}, "application/json"
    else:
        body = {
            "type": conf.PROBLEM_TYPE_BASE + exc.name,
            "title": exc.title,
            "status": status,
            "detail": exc.detail,
            **exc.extra,
        }
        content_type = PROBLEM_CONTENT_TYPE
    response = HttpResponse(json.dumps(body), status=status, content_type=content_type)
    return with_error_headers(response, exc)


def with_error_headers(response: R, exc: IdempotencyError) -> R:
    """``response`` with what every answer to ``exc`` carries, whoever rendered its body:
    never cached, and the error's own headers (``Retry-After``)."""
    response["Cache-Control"] = "no-store"
    for name, value in exc.headers.items():
        response[name] = value
    return response


def unsupported_media_type(content_type: str | None, reason: str) -> dict[str, str]:
    """The body of a view's 415 for a body it cannot parse, in the words of DRF's, whatever
    the view style answers it (plain, ``@api_view``, Ninja)."""
    return {"detail": f'Unsupported media type "{content_type}" in request: {reason}.'}


def possible_errors(policy: Policy) -> list[type[IdempotencyError]]:
    """The errors a covered request may get instead of its view's answer, given the view's
    policy and the settings: what API schemas document."""
    errors: list[type[IdempotencyError]] = [InvalidKey, KeyReused, InProgress, StoreUnavailable]
    if policy.required:
        errors.insert(0, MissingKey)
    if conf.EXPIRED_WINDOW:
        errors.append(KeyExpired)
    if policy.version is not None and not policy.rerun_other_versions:
        errors.append(VersionChanged)
    return errors
