"""Django REST framework glue: ``IdempotencyMixin`` for APIView, GenericAPIView and viewsets."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

from django.http.response import HttpResponseBase
from rest_framework.exceptions import NotAcceptable
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request

from django_idempotency.conf import PrincipalFunc
from django_idempotency.engine import unit as engine
from django_idempotency.engine.errors import IdempotencyError
from django_idempotency.problems import PROBLEM_CONTENT_TYPE, problem_response


class _Replay(Exception):
    # Carries a replay out of initial(), past the handler, to handle_exception().
    def __init__(self, response: HttpResponseBase) -> None:
        self.response = response


class IdempotencyMixin:
    """Make a view's POST and PATCH (by default) exactly-once per ``Idempotency-Key``.

    The key is claimed after authentication, permissions and throttling, in the same
    transaction as everything the handler writes; the response is stored before commit.
    Attributes left at ``None`` take the ``IDEMPOTENCY_*`` settings at request time.
    """

    idempotency_methods: Sequence[str] | None = None
    idempotency_required: bool | None = None
    idempotency_ttl: timedelta | None = None
    idempotency_wait: timedelta | None = None
    idempotency_exclude_fields: Sequence[str] | None = None
    idempotency_fingerprint_headers: Sequence[str] | None = None
    idempotency_principal: PrincipalFunc | None = None

    _idempotency: engine.Execution | None = None
    _idempotency_arrived: float | None = None
    _idempotency_covered = False

    def get_idempotency_options(self) -> engine.Options:
        principal = self.idempotency_principal
        return engine.Options.resolve(
            methods=self.idempotency_methods,
            required=self.idempotency_required,
            ttl=self.idempotency_ttl,
            wait=self.idempotency_wait,
            exclude_fields=self.idempotency_exclude_fields,
            fingerprint_headers=self.idempotency_fingerprint_headers,
            # A plain function stored on the class comes back bound to the view.
            principal=getattr(principal, "__func__", principal),
        )

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        try:
            return super().perform_content_negotiation(request, force)  # type: ignore[misc, no-any-return]
        except NotAcceptable:
            # A client that accepts only problem+json must still get our errors (not a
            # 406), and its success labelled truthfully by the view's first renderer.
            if PROBLEM_CONTENT_TYPE not in request.META.get("HTTP_ACCEPT", ""):
                raise
            return super().perform_content_negotiation(request, force=True)  # type: ignore[misc, no-any-return]

    def initialize_request(self, request: Any, *args: Any, **kwargs: Any) -> Request:
        self._idempotency_arrived = time.monotonic()
        return super().initialize_request(request, *args, **kwargs)  # type: ignore[misc, no-any-return]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        options = self.get_idempotency_options()
        django_request = request._request
        self._idempotency_covered = engine.covers(django_request, options)
        # Authentication usually queries the same database: if it is gone, answer 503.
        with engine.failing_closed() if self._idempotency_covered else nullcontext():
            super().initial(request, *args, **kwargs)  # type: ignore[misc]
        result = engine.begin(
            django_request,
            options,
            sender=type(self),
            principal_request=request,
            arrived=self._idempotency_arrived,
        )
        if isinstance(result, HttpResponseBase):
            raise _Replay(result)
        self._idempotency = result

    def perform_authentication(self, request: Request) -> None:
        # Keep the raw body for the fingerprint before an authenticator, permission or
        # throttle reads request.data, which consumes the stream (after content
        # negotiation, so that a body too large is answered like any other error).
        # Multipart is fingerprinted from the parsed fields instead.
        django_request = request._request
        if self._idempotency_covered and django_request.content_type != "multipart/form-data":
            django_request.body  # noqa: B018
        super().perform_authentication(request)  # type: ignore[misc]

    def handle_exception(self, exc: Exception) -> HttpResponseBase:
        if isinstance(exc, _Replay):
            return exc.response
        if isinstance(exc, IdempotencyError):
            return problem_response(exc)
        return super().handle_exception(exc)  # type: ignore[misc, no-any-return]

    def finalize_response(
        self, request: Request, response: HttpResponseBase, *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        execution, self._idempotency = self._idempotency, None
        if execution is None:
            return response
        try:
            return execution.finish(response)
        except IdempotencyError as exc:
            return problem_response(exc)

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
        try:
            return super().dispatch(request, *args, **kwargs)  # type: ignore[misc, no-any-return]
        finally:
            # An exception escaped the view (DRF re-raises what it cannot handle), so
            # finalize_response never ran: roll the claim back with everything else.
            execution, self._idempotency = self._idempotency, None
            if execution is not None:
                execution.abort()
