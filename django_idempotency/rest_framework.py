"""Django REST framework glue: ``IdempotencyMixin`` for APIView, GenericAPIView and viewsets,
and for adrf's async views."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from inspect import isawaitable
from typing import Any

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import router
from django.http import Http404, HttpRequest
from django.http.response import HttpResponseBase
from rest_framework.exceptions import APIException, NotAcceptable, UnsupportedMediaType
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency.conf import PrincipalFunc, conf
from django_idempotency.engine.errors import IdempotencyError
from django_idempotency.engine.unit import failing_closed
from django_idempotency.engine.work import Refuse, Replay, view_name
from django_idempotency.http.endpoints import written_model
from django_idempotency.http.identity import has_body, unparseable_multipart
from django_idempotency.http.options import (
    OPTION_NAMES,
    KeyFunc,
    Policy,
    ViewOptions,
    policy_for,
)
from django_idempotency.http.problems import (
    PROBLEM_CONTENT_TYPE,
    problem_response,
    status_for,
    with_error_headers,
)
from django_idempotency.http.request import Answer, Probed, RequestUnit, lost_or_raise


class Answered(Exception):
    """Leaves ``initial()`` with a replay or a refusal, the way DRF's own checks leave it
    with an exception; ``handle_exception()`` turns it back into the response."""

    def __init__(self, response: HttpResponseBase) -> None:
        self.response = response


class IdempotencyAPIException(APIException):
    """A refusal of the key (409, 422, 400, ...) handed to ``REST_FRAMEWORK``'s
    ``EXCEPTION_HANDLER`` when ``IDEMPOTENCY_DRF_EXCEPTION_HANDLER`` is on: ``detail`` and
    its code (``"key-reused"``) as DRF's own errors have them, and the engine's ``error``
    for a handler that wants more (``error.title``, ``error.extra``)."""

    def __init__(self, error: IdempotencyError) -> None:
        super().__init__(detail=error.detail, code=error.name)
        self.status_code = status_for(error)
        self.error = error


class IdempotencyMixin:
    """Make a view's POST and PATCH (by default) exactly-once per ``Idempotency-Key``.

    The key is claimed after authentication, permissions and throttling, in the same
    transaction as everything the handler writes; the response is stored before commit.
    Set ``idempotency_<option>`` attributes (the keyword arguments of ``@idempotent``:
    ``methods``, ``required``, ``ttl``, ``wait``, ``exclude_fields``,
    ``fingerprint_headers``, ``principal``, ``lookup_first``, and for a webhook receiver
    ``key_header`` or ``key_from``); those left at ``None`` take
    the ``IDEMPOTENCY_*`` settings. Options are resolved once per view class. It protects
    adrf's async views too, with the same guarantee.
    """

    # One attribute per option of ViewOptions (as_view() accepts only existing attributes);
    # None means "ask the settings when the request arrives".
    idempotency_methods: Sequence[str] | None = None
    idempotency_required: bool | None = None
    idempotency_ttl: timedelta | None = None
    idempotency_wait: timedelta | None = None
    idempotency_exclude_fields: Sequence[str] | None = None
    idempotency_fingerprint_headers: Sequence[str] | None = None
    idempotency_principal: PrincipalFunc | None = None
    idempotency_lookup_first: bool | None = None
    idempotency_key_header: str | None = None
    idempotency_key_from: KeyFunc | None = None
    idempotency_using: str | Callable[[HttpRequest], str] | None = None
    idempotency_allow_anonymous: bool | None = None
    idempotency_response_version: str | None = None
    idempotency_rerun_other_versions: bool | None = None

    _idempotency: RequestUnit | None = None
    _closes_after_dispatch = False
    http_method_names: list[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # APIView's initial() and finalize_response() call no super(): a mixin after it in
        # the MRO is never reached, and the view runs unprotected without a word.
        mro = cls.__mro__
        if APIView in mro and mro.index(APIView) < mro.index(IdempotencyMixin):
            raise ImproperlyConfigured(
                f"{view_name(cls)} lists IdempotencyMixin after a DRF "
                "view class in its bases, so the mixin would never run and the view would "
                "not be idempotent. Put IdempotencyMixin first: "
                f"class {cls.__name__}(IdempotencyMixin, ...)."
            )

    def get_idempotency_options(self) -> ViewOptions:
        options: Any = {name: getattr(self, f"idempotency_{name}") for name in OPTION_NAMES}
        return options  # type: ignore[no-any-return]

    def get_idempotency_policy(self) -> Policy:
        return policy_for(type(self), self.get_idempotency_options())

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        try:
            return super().perform_content_negotiation(request, force)  # type: ignore[misc, no-any-return]
        except NotAcceptable:
            # A client that accepts only problem+json must still get our errors (not a
            # 406), and its success labelled truthfully by the view's first renderer.
            if PROBLEM_CONTENT_TYPE not in request.headers.get("accept", ""):
                raise
            return super().perform_content_negotiation(request, force=True)  # type: ignore[misc, no-any-return]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        unit = RequestUnit(
            request._request,
            self.get_idempotency_policy(),
            sender=type(self),
            model=written_model(self),
        )
        method = (request.method or "").lower()
        handler = getattr(self, method, None) if method in self.http_method_names else None
        if not unit.covered:
            # Django's and DRF's own behaviour; a keyless request of a protected method then
            # runs in a transaction of its own.
            super().initial(request, *args, **kwargs)  # type: ignore[misc]
            if not unit.keyless or handler is None:
                return
        else:
            with failing_closed():  # authentication usually queries the same database
                super().initial(request, *args, **kwargs)  # type: ignore[misc]
            if handler is None:
                # DRF answers 405 right after initial(): nothing is claimed, so the key stays
                # free for the request the client meant.
                return
            require_parser(request)
        renderers = getattr(self, "renderer_classes", ())
        media_type = request.accepted_media_type if len(renderers) > 1 else None
        if getattr(self, "view_is_async", False):
            # adrf runs initial() on a thread: claim in the handler instead, on the event
            # loop, where a duplicate waits without holding a thread.
            setattr(self, method, self._claiming(handler, unit, media_type))
            return
        decision = unit.open(principal_request=request, media_type=media_type)
        if isinstance(decision, Replay | Probed):
            self._check_object_permissions()
        self._hold(unit, decision)

    def _claiming(
        self, handler: Callable[..., Any], unit: RequestUnit, media_type: str | None
    ) -> Callable[..., Awaitable[Any]]:
        """The async view's handler, behind the claim of its key."""
        if not iscoroutinefunction(handler):
            handler = sync_to_async(handler)

        async def claimed(request: Request, *args: Any, **kwargs: Any) -> Any:
            decision = await unit.aopen(principal_request=request, media_type=media_type)
            if isinstance(decision, Replay | Probed):
                await sync_to_async(self._check_object_permissions)()
            self._hold(unit, decision)
            return await handler(request, *args, **kwargs)

        return claimed

    def _hold(self, unit: RequestUnit, decision: Answer) -> None:
        """After ``Run``, keep the unit for ``close()``; else leave with the answer."""
        if isinstance(decision, Refuse) and conf.DRF_EXCEPTION_HANDLER:
            raise decision.error  # to the project's EXCEPTION_HANDLER (handle_exception)
        answered = unit.answer_for(decision)
        if answered is not None:
            raise Answered(answered)
        self._idempotency = unit

    def _check_object_permissions(self) -> None:
        # A detail route checks permissions on its object inside the handler, which a
        # replay (and a probe) skips: check them here, so a replay never outlives a revoked
        # permission, and a probe meets what the request would.
        kwargs = getattr(self, "kwargs", {}) or {}
        lookup = getattr(self, "lookup_url_kwarg", None) or getattr(self, "lookup_field", None)
        if lookup and lookup in kwargs and hasattr(self, "get_object"):
            try:
                self.get_object()
            except Http404:
                # An object that no longer exists (a DELETE's retry) has no permission left
                # to check, and the record is this principal's own: replay it. One that
                # exists but that the view's queryset hides from this client stays a 404.
                if _object_exists(self, kwargs[lookup]):
                    raise

    def handle_exception(self, exc: Exception) -> HttpResponseBase:
        if isinstance(exc, Answered):
            return exc.response
        if isinstance(exc, IdempotencyError):
            if not conf.DRF_EXCEPTION_HANDLER:
                return problem_response(exc)
            response = super().handle_exception(IdempotencyAPIException(exc))  # type: ignore[misc]
            return with_error_headers(response, exc)  # type: ignore[no-any-return]
        return super().handle_exception(exc)  # type: ignore[misc, no-any-return]

    def finalize_response(
        self, request: Request, response: HttpResponseBase, *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        if self._closes_after_dispatch:
            return response
        unit = self._take_unit()
        return response if unit is None else unit.close(response)

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            response = super().dispatch(request, *args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            # An exception escaped the view (DRF re-raises what it cannot handle), so
            # finalize_response never ran: roll the claim back with everything else.
            unit = self._take_unit()
            return lost_or_raise(exc, None if unit is None else unit.fail(exc))
        if isawaitable(response):
            # adrf's async dispatch, not started yet. Its finalize_response will run on the
            # event loop, where the ORM may not: close the unit after it instead.
            self._closes_after_dispatch = True
            return self._close_after(response)
        return response

    async def _close_after(self, dispatching: Awaitable[HttpResponseBase]) -> HttpResponseBase:
        # adrf runs initial() through sync_to_async (thread-sensitive), so the claim's
        # transaction opened on the request's one sync thread; the handler's async ORM calls
        # and these close/fail calls run there too, so they all share that transaction.
        try:
            response = await dispatching
        except BaseException as exc:
            unit = self._take_unit()
            return lost_or_raise(exc, None if unit is None else await sync_to_async(unit.fail)(exc))
        unit = self._take_unit()
        return response if unit is None else await sync_to_async(unit.close)(response)

    def _take_unit(self) -> RequestUnit | None:
        unit, self._idempotency = self._idempotency, None
        return unit


def _object_exists(view: Any, value: Any) -> bool:
    """Whether the object a detail route names exists at all, on the primary (a replica
    may still hold what was deleted), whatever the view's queryset shows this client."""
    model = view.get_queryset().model
    manager = model._default_manager.db_manager(router.db_for_write(model))
    try:
        return bool(manager.filter(**{view.lookup_field: value}).exists())
    except (TypeError, ValueError, ValidationError):  # what get_object() answers 404 too
        return False


def require_parser(request: Request) -> None:
    """A body that none of the view's parsers accepts, or a multipart body that Django
    cannot parse, is answered 415 before it is read, fingerprinted or stored."""
    if not has_body(request.META):
        return
    negotiator, parsers = request.negotiator, request.parsers or ()
    if negotiator is not None and negotiator.select_parser(request, parsers) is None:
        raise UnsupportedMediaType(request.content_type)
    if unparseable_multipart(request._request) is not None:
        raise UnsupportedMediaType(request.content_type)
