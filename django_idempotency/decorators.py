"""``@idempotent`` for plain Django views."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, overload

from django.core.exceptions import BadRequest, PermissionDenied, SuspiciousOperation
from django.core.handlers.exception import response_for_exception
from django.http import Http404, HttpRequest
from django.http.response import HttpResponseBase

from django_idempotency.conf import PrincipalFunc
from django_idempotency.engine import unit as engine
from django_idempotency.engine.errors import IdempotencyError
from django_idempotency.problems import problem_response

# Exceptions that Django turns into a 4xx response rather than a 500.
CLIENT_ERRORS = (Http404, PermissionDenied, BadRequest, SuspiciousOperation)

View = TypeVar("View", bound=Callable[..., HttpResponseBase])


@overload
def idempotent(view: View) -> View: ...
@overload
def idempotent(
    view: None = None,
    *,
    methods: Sequence[str] | None = None,
    required: bool | None = None,
    ttl: timedelta | None = None,
    wait: timedelta | None = None,
    exclude_fields: Sequence[str] | None = None,
    fingerprint_headers: Sequence[str] | None = None,
    principal: PrincipalFunc | None = None,
) -> Callable[[View], View]: ...
def idempotent(view: Any = None, **overrides: Any) -> Any:
    """Make a plain view exactly-once per ``Idempotency-Key``.

    Put it below authentication decorators such as ``login_required``, so that access
    control runs before a replay. Keyword arguments override the settings for this view.
    """

    def decorate(func: View) -> View:
        @functools.wraps(func)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            arrived = time.monotonic()
            try:
                result = engine.begin(
                    request, engine.Options.resolve(**overrides), sender=func, arrived=arrived
                )
            except IdempotencyError as exc:
                return problem_response(exc)
            if result is None:
                return func(request, *args, **kwargs)
            if isinstance(result, HttpResponseBase):
                return result
            try:
                response = func(request, *args, **kwargs)
            except CLIENT_ERRORS as exc:
                # Django would answer these with a 4xx after we returned; answer here, so
                # the outcome is stored and replayed as the same 4xx from DRF would be.
                response = response_for_exception(request, exc)
            except BaseException:
                result.abort()
                raise
            try:
                return result.finish(response)
            except IdempotencyError as exc:
                return problem_response(exc)

        # How the admin finds idempotent plain views in the URLconf.
        wrapper.idempotency_overrides = dict(overrides)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate(view) if view is not None else decorate
