"""``@idempotent`` for plain Django views, sync or async, and DRF's ``@api_view``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, Unpack, overload

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import BadRequest, PermissionDenied, SuspiciousOperation
from django.core.handlers.exception import response_for_exception
from django.http import Http404, HttpRequest
from django.http.response import HttpResponseBase

from django_idempotency.engine.options import ViewOptions, policy_for
from django_idempotency.engine.unit import RequestUnit, Run

# Exceptions that Django turns into a 4xx response rather than a 500.
CLIENT_ERRORS = (Http404, PermissionDenied, BadRequest, SuspiciousOperation)

View = TypeVar("View", bound=Callable[..., Any])


@overload
def idempotent(view: View) -> View: ...
@overload
def idempotent(view: None = None, **options: Unpack[ViewOptions]) -> Callable[[View], View]: ...
def idempotent(view: Any = None, **options: Unpack[ViewOptions]) -> Any:
    """Make a view exactly-once per ``Idempotency-Key``: a plain Django view (``def`` or
    ``async def``) or a function under DRF's ``@api_view``.

    Put it below authentication decorators such as ``login_required``, so that access
    control runs before a replay. Keyword arguments override the settings for this view.
    """

    def decorate(func: View) -> View:
        def policy(request: Any) -> RequestUnit:
            # Django's request, under DRF's too: the key and body are read from it.
            return RequestUnit(
                getattr(request, "_request", request),
                policy_for(func, options),
                sender=func,
            )

        if iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
                unit = policy(request)
                if not unit.covered:
                    return await func(request, *args, **kwargs)
                # The unit's transaction lives on the thread that claimed it: every
                # sync_to_async(thread_sensitive=True) call of this request (Django's async
                # ORM) runs there, so the view's writes join the claim's transaction. A
                # duplicate waits on the event loop.
                decision = await unit.aopen(principal_request=request)
                if not isinstance(decision, Run):
                    return decision.response()
                try:
                    response = _answer(request, await func(request, *args, **kwargs))
                except BaseException as exc:
                    answered = _client_error(request, exc)
                    if answered is None:
                        await sync_to_async(unit.fail)(exc)
                        raise
                    response = answered
                return await sync_to_async(unit.close)(response)

            wrapper: Any = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
                unit = policy(request)
                if not unit.covered:
                    return func(request, *args, **kwargs)
                decision = unit.open(principal_request=request)
                if not isinstance(decision, Run):
                    return decision.response()
                try:
                    response = _answer(request, func(request, *args, **kwargs))
                except BaseException as exc:
                    answered = _client_error(request, exc)
                    if answered is None:
                        unit.fail(exc)
                        raise
                    response = answered
                return unit.close(response)

            wrapper = sync_wrapper

        # How the admin finds idempotent plain views in the URLconf.
        wrapper.idempotency_options = dict(options)
        return wrapper  # type: ignore[no-any-return]

    return decorate(view) if view is not None else decorate


def _drf_view(request: Any) -> Any:
    """The APIView that DRF's ``@api_view`` runs this function in, if any."""
    context = getattr(request, "parser_context", None)
    return context.get("view") if context else None


def _answer(request: Any, response: HttpResponseBase) -> HttpResponseBase:
    # Under @api_view, DRF renders the response only after we return: render it now, as
    # DRF would, so that what is stored is what the client gets.
    view = _drf_view(request)
    return response if view is None else view.finalize_response(request, response)


def _client_error(request: Any, exc: BaseException) -> HttpResponseBase | None:
    """The 4xx that Django (or DRF, under ``@api_view``) would answer ``exc`` with, so the
    outcome is stored and replayed like any other; None for errors that are 5xx."""
    view = _drf_view(request)
    if view is not None and isinstance(exc, Exception):
        from rest_framework.exceptions import APIException

        if isinstance(exc, APIException | Http404 | PermissionDenied):
            return _answer(request, view.handle_exception(exc))
    if isinstance(exc, CLIENT_ERRORS):
        django_request: HttpRequest = getattr(request, "_request", request)
        return response_for_exception(django_request, exc)
    return None
