"""``@idempotent`` for plain Django views, sync or async, and DRF's ``@api_view``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, Unpack, overload

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import BadRequest, PermissionDenied, SuspiciousOperation
from django.core.handlers.exception import response_for_exception
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.http.request import RawPostDataException
from django.http.response import HttpResponseBase

from django_idempotency.engine.errors import IdempotencyError
from django_idempotency.http import problems
from django_idempotency.http.identity import unparseable_multipart
from django_idempotency.http.options import ViewOptions, policy_for
from django_idempotency.http.request import RequestUnit, lost_or_raise

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
        # method_decorator() decorates a new partial of the method on every request: the
        # policy is cached for the method it wraps.
        owner = inspect.unwrap(func)

        def unit_for(request: Any) -> RequestUnit | HttpResponseBase | None:
            """The request's unit; or the answer instead (settings of the wrong type, a body
            the view cannot parse); or None when the request is not covered."""
            try:
                policy = policy_for(owner, options)
            except IdempotencyError as error:
                return problems.problem_response(error)
            # Django's request, under DRF's too: the key and body are read from it.
            unit = RequestUnit(getattr(request, "_request", request), policy, sender=func)
            if unit.keyless:  # runs in a transaction, with nothing of ours read or stored
                return unit
            if not unit.covered or not offers(func, request.method or ""):
                # A method the view does not have: it answers 405 itself, and nothing is
                # claimed, so the key stays free for the request the client meant.
                return None
            refused = _unsupported(request)
            return unit if refused is None else refused

        if iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
                unit = unit_for(request)
                if unit is None:
                    return await func(request, *args, **kwargs)
                if isinstance(unit, HttpResponseBase):
                    return unit
                # The unit's transaction lives on the thread that claimed it, where Django's
                # async ORM runs this request's queries; a duplicate waits on the event loop.
                decision = await unit.aopen(
                    principal_request=request, media_type=_media_type(request)
                )
                instead = unit.answer_for(decision)
                if instead is not None:
                    return instead
                try:
                    response = _answer(request, await func(request, *args, **kwargs))
                except BaseException as exc:
                    kept = _kept(request, exc)
                    if kept is None:
                        return _failed(request, exc, await sync_to_async(unit.fail)(exc))
                    response = kept
                return await sync_to_async(unit.close)(response)

            wrapper: Any = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
                unit = unit_for(request)
                if unit is None:
                    return func(request, *args, **kwargs)
                if isinstance(unit, HttpResponseBase):
                    return unit
                decision = unit.open(principal_request=request, media_type=_media_type(request))
                instead = unit.answer_for(decision)
                if instead is not None:
                    return instead
                try:
                    response = _answer(request, func(request, *args, **kwargs))
                except BaseException as exc:
                    kept = _kept(request, exc)
                    if kept is None:
                        return _failed(request, exc, unit.fail(exc))
                    response = kept
                return unit.close(response)

            wrapper = sync_wrapper

        # How the admin finds idempotent plain views in the URLconf.
        wrapper.idempotency_options = dict(options)
        return wrapper  # type: ignore[no-any-return]

    return decorate(view) if view is not None else decorate


def offers(view: Any, method: str) -> bool:
    """Whether the view that ``view`` wraps has a handler for ``method``, where that can be
    known before running it: a class-based view's ``http_method_names`` and handlers (the
    function ``as_view()`` made, or ``dispatch()`` under ``method_decorator``), Django's
    ``require_http_methods`` (and ``require_POST``, ...) inside; else True."""
    from django.views import View as ClassView

    name = method.lower()
    target = view
    while target is not None:
        owner = getattr(target, "view_class", None)
        # method_decorator() hands the decorator a partial of the bound method.
        bound = getattr(getattr(target, "func", None), "__self__", None)
        if owner is None and isinstance(bound, ClassView):
            owner = bound
        if owner is not None:
            return name in owner.http_method_names and hasattr(owner, name)
        code = getattr(target, "__code__", None)
        if code is not None and "request_method_list" in code.co_freevars:
            cell = target.__closure__[code.co_freevars.index("request_method_list")]
            return method in cell.cell_contents
        target = getattr(target, "__wrapped__", None)
    return True


def _drf_view(request: Any) -> Any:
    """The APIView that DRF's ``@api_view`` runs this function in, if any."""
    context = getattr(request, "parser_context", None)
    return context.get("view") if context else None


def _media_type(request: Any) -> str | None:
    """The media type DRF negotiated for an ``@api_view`` function that can answer in
    several: part of the fingerprint, so a replay is never in one the retry did not ask for
    (as for ``IdempotencyMixin``)."""
    view = _drf_view(request)
    if view is None or len(getattr(view, "renderer_classes", ())) < 2:
        return None
    media_type: str | None = getattr(request, "accepted_media_type", None)
    return media_type


def _answer(request: Any, response: HttpResponseBase) -> HttpResponseBase:
    # Under @api_view, DRF renders the response only after we return: render it now, as
    # DRF would, so that what is stored is what the client gets.
    view = _drf_view(request)
    return response if view is None else view.finalize_response(request, response)


def _unsupported(request: Any) -> HttpResponseBase | None:
    """The 415 for a body the view cannot parse, answered before anything reads it (so
    neither fingerprinted nor stored, and the key stays free): under ``@api_view`` one
    that none of its parsers accepts, and for any view a multipart body that Django
    cannot parse."""
    if _drf_view(request) is not None:
        from rest_framework.exceptions import UnsupportedMediaType

        from django_idempotency.rest_framework import require_parser

        try:
            require_parser(request)
        except UnsupportedMediaType as exc:
            return _client_error(request, exc)
        return None
    reason = unparseable_multipart(request)
    return None if reason is None else unsupported_media_type(request, reason)


def unsupported_media_type(request: HttpRequest, reason: str) -> HttpResponse:
    """A plain view's 415, in the words of DRF's."""
    return JsonResponse(problems.unsupported_media_type(request.content_type, reason), status=415)


def _unread(request: Any, exc: BaseException) -> bool:
    """The view read the raw body of a multipart request whose stream the fingerprint had
    parsed: it does not take multipart (a JSON view), so the 415 is not stored."""
    django_request: HttpRequest = getattr(request, "_request", request)
    return (
        isinstance(exc, RawPostDataException)
        and django_request.content_type == "multipart/form-data"
    )


def _kept(request: Any, exc: BaseException) -> HttpResponseBase | None:
    """The response that the view's exception stands for and that is stored like any other
    (a 4xx); None when the unit rolls back instead."""
    return None if _unread(request, exc) else _client_error(request, exc)


def _failed(request: Any, exc: BaseException, lost: HttpResponse | None) -> HttpResponseBase:
    """After the rollback: the 415 of a view that does not read multipart, a lost store's
    503 (``lost``), or the view's exception, raised again."""
    if _unread(request, exc):
        return unsupported_media_type(
            getattr(request, "_request", request), "this view does not read multipart bodies"
        )
    return lost_or_raise(exc, lost)


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
