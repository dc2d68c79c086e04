"""Django Ninja glue: ``idempotent_operation`` for an operation of a ``NinjaAPI`` or ``Router``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, TypeVar, Unpack, overload

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from ninja.operation import AsyncOperation, Operation
from ninja.utils import contribute_operation_callback

from django_idempotency.conf import conf
from django_idempotency.engine.errors import IdempotencyError
from django_idempotency.engine.unit import failing_closed
from django_idempotency.http.identity import MAX_KEY_LENGTH, has_body, unparseable_multipart
from django_idempotency.http.options import Policy, ViewOptions, policy_for
from django_idempotency.http.problems import (
    PROBLEM_CONTENT_TYPE,
    possible_errors,
    problem_response,
    status_for,
    unsupported_media_type,
)
from django_idempotency.http.request import Answer, RequestUnit

Func = TypeVar("Func", bound=Callable[..., Any])

# Where run() leaves the request's unit for _run_checks() to open after authentication.
_CLAIM = "_idempotency_claim"


@overload
def idempotent_operation(func: Func) -> Func: ...
@overload
def idempotent_operation(
    func: None = None, **options: Unpack[ViewOptions]
) -> Callable[[Func], Func]: ...
def idempotent_operation(func: Any = None, **options: Unpack[ViewOptions]) -> Any:
    """Make a Ninja operation exactly-once per ``Idempotency-Key``.

    Put it below ``@api.post(...)`` (or ``@router.post(...)``). The key is claimed after
    the operation's authentication and throttles, in the same transaction as everything
    the operation writes; the response Ninja renders, its own 4xx included, is stored
    before commit. Keyword arguments override the settings for this operation, as for
    ``@idempotent``. The principal is ``request.user``, else the user that the
    operation's ``auth`` returned; an ``auth`` that returns anything else needs a
    ``principal`` callable.
    """

    def decorate(view_func: Func) -> Func:
        operation = getattr(view_func, "_ninja_operation", None)
        if operation is not None:  # placed above @api.post: the operation exists already
            _protect(operation, options)
        else:
            contribute_operation_callback(view_func, partial(_protect, options=options))
        return view_func

    return decorate(func) if func is not None else decorate


class _Claim:
    """A request's unit of work, and whether its key is held (after ``Run``)."""

    __slots__ = ("claimed", "unit")

    def __init__(self, unit: RequestUnit) -> None:
        self.unit = unit
        self.claimed = False


class _Identity:
    """What ``principal_for`` reads by default (``.user``), for a user found in
    ``request.auth``."""

    def __init__(self, user: Any) -> None:
        self.user = user


class _Idempotent(Operation):
    """What both idempotent operation classes add to Ninja's: options that survive a clone,
    and the key header and the app's errors in the OpenAPI schema."""

    idempotency_options: ViewOptions

    def clone(self) -> Operation:
        # Ninja clones each operation per mount of its router: the options go along, and
        # the operation's own OpenAPI additions without ours (added again when read).
        cloned = super().clone()
        cloned.idempotency_options = self.idempotency_options  # type: ignore[attr-defined]
        cloned.__dict__["openapi_extra"] = self.__dict__.get("openapi_extra")
        return cloned

    @property
    def openapi_extra(self) -> dict[str, Any] | None:
        """Read by Ninja's schema: the settings of the moment decide what it says."""
        own: dict[str, Any] | None = self.__dict__.get("openapi_extra")
        try:
            policy = policy_for(self.view_func, self.idempotency_options)
        except IdempotencyError:  # settings of the wrong type: requests say so, not imports
            return own
        return _documented(own, policy) if policy.methods.intersection(self.methods) else own

    @openapi_extra.setter
    def openapi_extra(self, value: dict[str, Any] | None) -> None:
        self.__dict__["openapi_extra"] = value


class IdempotentOperation(_Idempotent):
    """Ninja's ``Operation`` with the key claimed between its checks and its view."""

    def run(self, request: HttpRequest, **kw: Any) -> HttpResponseBase:
        claim = _claim_for(self, request)
        if claim is None:
            return super().run(request, **kw)
        if isinstance(claim, HttpResponse):
            return claim
        try:
            response = super().run(request, **kw)
        except BaseException as exc:
            return _failed(claim, exc)
        return claim.unit.close(response) if claim.claimed else response

    def _run_checks(self, request: HttpRequest) -> HttpResponse | None:
        claim: _Claim | None = getattr(request, _CLAIM, None)
        if claim is None:
            return super()._run_checks(request)
        with _checking(claim):
            error = super()._run_checks(request)
        return error or _unsupported(self, claim, request) or _open(claim, request)


class AsyncIdempotentOperation(_Idempotent, AsyncOperation):
    """Ninja's ``AsyncOperation`` with the key claimed between its checks and its view."""

    async def run(self, request: HttpRequest, **kw: Any) -> HttpResponseBase:  # type: ignore[override]
        claim = _claim_for(self, request)
        if claim is None:
            return await super().run(request, **kw)
        if isinstance(claim, HttpResponse):
            return claim
        # The unit's transaction lives on the thread that opened it: every
        # sync_to_async(thread_sensitive=True) call of this request (Django's async ORM)
        # runs there, so the operation's writes join the claim's transaction.
        try:
            response = await super().run(request, **kw)
        except BaseException as exc:
            return await sync_to_async(_failed)(claim, exc)
        return await sync_to_async(claim.unit.close)(response) if claim.claimed else response

    async def _run_checks(self, request: HttpRequest) -> HttpResponse | None:  # type: ignore[override]
        claim: _Claim | None = getattr(request, _CLAIM, None)
        if claim is None:
            return await super()._run_checks(request)
        with _checking(claim):
            error = await super()._run_checks(request)
        return error or _unsupported(self, claim, request) or await _aopen(claim, request)


_subclasses: dict[type[Operation], type[Operation]] = {}


def _protect(operation: Operation, options: ViewOptions) -> None:
    base = type(operation)
    if not issubclass(base, _Idempotent):
        # Ninja picks Operation or AsyncOperation itself, with no hook to choose a class:
        # the operation becomes the idempotent one of its own class (a subclass stays one).
        operation.__class__ = _idempotent_class(base)
    operation.idempotency_options = options  # type: ignore[attr-defined]


def _idempotent_class(base: type[Operation]) -> type[Operation]:
    mixin: type[Operation]
    mixin = AsyncIdempotentOperation if issubclass(base, AsyncOperation) else IdempotentOperation
    if base in (Operation, AsyncOperation):
        return mixin
    return _subclasses.setdefault(base, type(base.__name__, (mixin, base), {}))


def _claim_for(operation: Any, request: HttpRequest) -> _Claim | HttpResponse | None:
    try:
        policy = policy_for(operation.view_func, operation.idempotency_options)
    except IdempotencyError as error:  # settings of the wrong type
        return problem_response(error)
    unit = RequestUnit(request, policy, sender=operation.view_func)
    if not unit.covered and not unit.keyless:
        return None
    claim = _Claim(unit)
    setattr(request, _CLAIM, claim)
    return claim


# Where an operation's parameters come from when it parses a multipart body.
_FORM_SOURCES = frozenset({"form", "file"})


def _checking(claim: _Claim) -> AbstractContextManager[None]:
    """Around the operation's checks: authentication usually queries the same database as
    the claim. A keyless request meets Ninja's own behaviour."""
    return nullcontext() if claim.unit.keyless else failing_closed()


def _unsupported(operation: Any, claim: _Claim, request: HttpRequest) -> HttpResponse | None:
    """The 415 for a multipart body that the operation cannot parse (it takes no ``Form``
    or ``File`` parameter, or Django cannot parse the body), before anything reads it: not
    fingerprinted, not stored, and the key stays free. A keyless request is Ninja's own."""
    if claim.unit.keyless:
        return None
    if request.content_type != "multipart/form-data" or not has_body(request.META):
        return None
    reason = unparseable_multipart(request)
    if reason is None:
        sources = {getattr(model, "__ninja_param_source__", None) for model in operation.models}
        if sources & _FORM_SOURCES:
            return None
        reason = "this operation takes no form or file parameters"
    response: HttpResponse = operation.api.create_response(
        request, unsupported_media_type(request.content_type, reason), status=415
    )
    return response


def _open(claim: _Claim, request: HttpRequest) -> HttpResponse | None:
    """Claim the key now that the client is authenticated: None to run the view, or the
    replay or refusal to answer with."""
    decision = claim.unit.open(principal_request=_principal_request(claim, request))
    return _decided(claim, decision)


async def _aopen(claim: _Claim, request: HttpRequest) -> HttpResponse | None:
    """``_open`` for an async operation: a duplicate waits on the event loop."""
    # A keyless request has no principal to find: no hop to a thread for it.
    principal_request = (
        None if claim.unit.keyless else await sync_to_async(_principal_request)(claim, request)
    )
    decision = await claim.unit.aopen(principal_request=principal_request)
    return _decided(claim, decision)


def _decided(claim: _Claim, decision: Answer) -> HttpResponse | None:
    answer = claim.unit.answer_for(decision)
    claim.claimed = answer is None
    return answer


def _failed(claim: _Claim, exc: BaseException) -> HttpResponseBase:
    """An exception left Ninja (it re-raises what it has no handler for, unless DEBUG):
    roll back; a store outage (or a connection lost under the operation) becomes its problem
    response, anything else goes on up."""
    if claim.claimed:
        claim.claimed = False
        lost = claim.unit.fail(exc)
        if lost is not None:
            return lost
    if isinstance(exc, IdempotencyError):
        return problem_response(exc)
    raise exc


def _principal_request(claim: _Claim, request: HttpRequest) -> Any:
    policy = claim.unit.policy
    if claim.unit.keyless:  # no key, no principal: the operation runs in a transaction
        return None
    if policy.principal is not None:
        return request
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return request
    auth = getattr(request, "auth", None)
    if not auth:  # an operation without auth: one anonymous scope, as for any open view
        return request
    if getattr(auth, "is_authenticated", False) is True and getattr(auth, "pk", None) is not None:
        return _Identity(auth)
    # Scoping such keys as anonymous would let one client replay another's response.
    raise ImproperlyConfigured(
        f"The auth of an idempotent Ninja operation returned a {type(auth).__name__}, not a "
        "user, so whose key this is cannot be known. Pass principal=<callable> to "
        "idempotent_operation(), or set IDEMPOTENCY_PRINCIPAL."
    )


def _documented(extra: dict[str, Any] | None, policy: Policy) -> dict[str, Any]:
    """The operation's own OpenAPI additions, and the key header and the errors the app may
    answer instead of running it."""
    responses: dict[int, Any] = {}
    for error in possible_errors(policy):
        titles = responses.setdefault(status_for(error), [])
        titles.append(f"{error.name}: {error.title}")
    media_type = PROBLEM_CONTENT_TYPE if conf.ERROR_FORMAT == "problem" else "application/json"
    header = {
        "in": "header",
        "name": policy.header,
        "required": policy.required,
        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH + 2},
        "description": "Makes this request safe to retry: a retry with the same key and the "
        "same request gets the first response back, with `Idempotent-Replayed: true`.",
    }
    own = dict(extra or {})
    return {
        **own,
        # A key read by key_from is no parameter of the request's.
        "parameters": [*([] if policy.key_from else [header]), *own.get("parameters", [])],
        "responses": {
            **{
                status: {
                    "description": "; ".join(titles),
                    "content": {media_type: {"schema": {"type": "object"}}},
                }
                for status, titles in sorted(responses.items())
            },
            **own.get("responses", {}),
        },
    }
