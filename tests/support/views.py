"""Test-only views: one scripted handler behind the DRF mixin and behind ``@idempotent``.

The request body is a script (see ``tests.factories.ScriptFactory``): ``tag`` names the
run, ``status`` the answer, ``fail`` (``"raise"`` or a status via ``fail_status``, with
``once``) a failure after the business write, ``gate`` holds the first call until the test
opens it, ``reject`` (``"invalid"``, ``"notfound"``) answers 400/404 before writing,
``lose_connection`` has the server end the connection after the write,
``headers`` / ``cookie`` / ``pad`` / ``random_bytes`` / ``stream`` shape the response.

Every run writes one ``auth.Group`` named ``<tag>:<n>`` (the business row) and is counted
in ``CALLS``, in memory, so a count survives the rollback of the row.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any

from adrf.views import APIView as AsyncAPIView
from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import Group
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError, connection, transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers, viewsets
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.decorators import (
    action,
    api_view,
    authentication_classes,
    permission_classes,
    renderer_classes,
)
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.permissions import AllowAny, BasePermission, IsAuthenticated
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.rest_framework import IdempotencyMixin

# How long a gated handler waits for the test before giving up (a test that forgot to
# open its gate must not hang the live server forever).
GATE_TIMEOUT = 60


class Calls:
    """How many times each tag's handler ran in this process, rollbacks included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def hit(self, tag: str) -> int:
        with self._lock:
            self._counts[tag] += 1
            return self._counts[tag]

    def __getitem__(self, tag: str) -> int:
        with self._lock:
            return self._counts[tag]


class Gates:
    """Hold the first run of a tag inside its transaction until the test opens the gate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entered: dict[str, threading.Event] = {}
        self._opened: dict[str, threading.Event] = {}

    def _events(self, name: str) -> tuple[threading.Event, threading.Event]:
        with self._lock:
            return (
                self._entered.setdefault(name, threading.Event()),
                self._opened.setdefault(name, threading.Event()),
            )

    def pass_through(self, name: str) -> None:
        entered, opened = self._events(name)
        entered.set()
        if not opened.wait(GATE_TIMEOUT):
            raise RuntimeError(f"gate {name!r} was never opened")

    def wait_entered(self, name: str, timeout: float = GATE_TIMEOUT) -> bool:
        return self._events(name)[0].wait(timeout)

    def open(self, name: str) -> None:
        self._events(name)[1].set()


CALLS = Calls()
GATES = Gates()


class Boom(Exception):
    """Raised by a scripted handler after its business write."""


def business_rows(tag: str) -> int:
    """Committed business rows of a tag (one per execution that committed)."""
    return Group.objects.filter(name__startswith=f"{tag}:").count()


def lose_connection() -> None:
    """Have the database server end this thread's connection, as a failover or a network
    cut would, while the handler keeps going."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()

    def terminate() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        finally:
            connection.close()

    killer = threading.Thread(target=terminate)
    killer.start()
    killer.join(30)


def perform(script: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """Run a script: count, maybe wait, maybe reject, write the row, maybe fail."""
    tag = str(script.get("tag", "untagged"))
    n = CALLS.hit(tag)
    if script.get("gate") and n == 1:
        GATES.pass_through(str(script["gate"]))
    if script.get("sleep"):
        time.sleep(float(script["sleep"]))
    reject = script.get("reject")
    if reject == "invalid":
        # ``pad`` makes the error echo a large invalid value, as DRF does.
        detail = "x" * int(script.get("pad", 0)) or "Ensure this value is greater than 0."
        raise ValidationError({"amount": [detail]})
    if reject == "notfound":
        raise NotFound("No such thing.")
    if script.get("durable"):
        with transaction.atomic(durable=True):
            group = Group.objects.create(name=f"{tag}:{n}")
    else:
        group = Group.objects.create(name=f"{tag}:{n}")
    if script.get("rollback_only"):
        # Writes, then gives up on the transaction without raising: nothing commits.
        transaction.set_rollback(True)
    if script.get("swallow_db_error"):
        # The "ignore the duplicate" pattern without a savepoint: the transaction is broken.
        with contextlib.suppress(IntegrityError):
            Group.objects.create(name=group.name)
    if script.get("lose_connection") and n == 1:
        lose_connection()
    failing = bool(script.get("fail")) and (n == 1 or not script.get("once"))
    if failing and script["fail"] == "raise":
        raise Boom(f"{tag} failed after writing")
    status = int(script.get("fail_status", 500)) if failing else int(script.get("status", 201))
    return status, {"tag": tag, "execution": n, "group": group.pk, "nonce": uuid.uuid4().hex}


def shape(response: HttpResponseBase, script: Mapping[str, Any]) -> HttpResponseBase:
    for name, value in dict(script.get("headers") or {}).items():
        response[name] = value
    if script.get("cookie"):
        response.set_cookie("sid", str(script["cookie"]))
    return response


def special_body(script: Mapping[str, Any], payload: dict[str, Any]) -> HttpResponseBase | None:
    """Bodies a JSON renderer cannot make: a stream, incompressible bytes."""
    if script.get("stream"):
        return StreamingHttpResponse(iter([b"one", b"two"]), content_type="text/plain")
    if script.get("random_bytes"):
        # Different on every execution, so a replay is recognisable.
        return HttpResponse(
            os.urandom(int(script["random_bytes"])), content_type="application/octet-stream"
        )
    if script.get("pad"):
        payload["pad"] = "0123456789abcdef" * (int(script["pad"]) // 16)
    return None


class ScriptedView(IdempotencyMixin, APIView):
    """The scripted handler behind the DRF mixin; overrides come from ``as_view(...)``."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [AllowAny]
    # The tests' anonymous clients send keys of their own (uuid4): anonymous keys are meant
    # here. /drf/identified/ is the view that did not opt in.
    idempotency_allow_anonymous = True
    parser_classes = [JSONParser, FormParser, MultiPartParser]

    def handle(self, request: Request) -> HttpResponseBase:
        data = request.data if isinstance(request.data, Mapping) else {}
        script = {**request.query_params.dict(), **data}
        status, payload = perform(script)
        response = special_body(script, payload) or Response(payload, status=status)
        response.status_code = status
        return shape(response, script)

    post = put = patch = delete = get = handle


class AsyncScriptedView(IdempotencyMixin, AsyncAPIView):
    """The scripted handler as an async DRF view (adrf), behind the same mixin."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [AllowAny]
    parser_classes = [JSONParser, FormParser, MultiPartParser]
    idempotency_allow_anonymous = True

    async def post(self, request: Request) -> HttpResponseBase:
        data = request.data if isinstance(request.data, Mapping) else {}
        script = {**request.query_params.dict(), **data}
        # The ORM through sync_to_async, as Django's async ORM calls it: on the request's
        # sync thread, inside the claim's transaction.
        status, payload = await sync_to_async(perform)(script)
        response = special_body(script, payload) or Response(payload, status=status)
        response.status_code = status
        return shape(response, script)


class DenyOnHeader(BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        return request.headers.get("X-Deny") != "yes"


class DenyObjectOnHeader(BasePermission):
    """Object-level: refused when the request says its object is no longer the user's."""

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return request.headers.get("X-Deny-Object") != "yes"


class PlainTextRenderer(BaseRenderer):
    media_type = "text/plain"
    format = "txt"

    def render(self, data: Any, accepted_media_type: Any = None, context: Any = None) -> bytes:
        return repr(data).encode()


class NegotiatedView(ScriptedView):
    """Answers in JSON or plain text, as the client asks."""

    renderer_classes = [JSONRenderer, PlainTextRenderer]


class DurableView(IdempotencyMixin, APIView):
    """Writes in a durable block, which cannot run inside the claim's transaction."""

    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        with transaction.atomic(durable=True):
            Group.objects.create(name=uuid.uuid4().hex)
        return Response(status=201)


class JSONOnlyView(ScriptedView):
    parser_classes = [JSONParser]


@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent(allow_anonymous=True)
def api_view_charge(request: Request) -> Response:
    """DRF's function-based views with @idempotent under @api_view."""
    script = dict(request.data) if isinstance(request.data, Mapping) else {}
    status, payload = perform(script)
    return Response(payload, status=status)


@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent
def api_view_identified(request: Request) -> Response:
    """An @api_view function open to anonymous clients that did not opt in to their keys."""
    return Response({"ran": True}, status=201)


@api_view(["POST"])
@permission_classes([AllowAny])
@renderer_classes([JSONRenderer, PlainTextRenderer])
@idempotent(allow_anonymous=True)
def api_view_negotiated(request: Request) -> Response:
    """An @api_view function that answers in JSON or plain text, as the client asks."""
    script = dict(request.data) if isinstance(request.data, Mapping) else {}
    status, payload = perform(script)
    return Response(payload, status=status)


class ThrottleOnHeader(BaseThrottle):
    def allow_request(self, request: Request, view: Any) -> bool:
        return request.headers.get("X-Throttle") != "deny"

    def wait(self) -> float:
        return 7


class GuardedView(ScriptedView):
    """Token authentication, a permission and a throttle in front of the handler."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated, DenyOnHeader]
    throttle_classes = [ThrottleOnHeader]


class Upload(IdempotencyMixin, APIView):
    """Echo form and multipart fields and file digests, counted by the ``tag`` query."""

    permission_classes = [AllowAny]
    parser_classes = [FormParser, MultiPartParser]
    idempotency_allow_anonymous = True

    def post(self, request: Request) -> Response:
        tag = request.query_params.get("tag", "upload")
        files = {
            name: hashlib.sha256(upload.read()).hexdigest()
            for name, upload in request.FILES.items()
        }
        fields = sorted(
            (name, value)
            for name in request.data
            if name not in request.FILES
            for value in request.data.getlist(name)
        )
        return Response(
            {
                "execution": CALLS.hit(tag),
                "fields": fields,
                "files": files,
                "nonce": uuid.uuid4().hex,
            },
            status=201,
        )


TRACE: list[str] = []


class Tracing:
    """Another mixin overriding the same DRF hooks, behind IdempotencyMixin in the MRO."""

    def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
        TRACE.append("initial")
        super().initial(request, *args, **kwargs)  # type: ignore[misc]

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        TRACE.append("finalize_response")
        return super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        TRACE.append("dispatch")
        return super().dispatch(request, *args, **kwargs)  # type: ignore[misc]


class TracedView(IdempotencyMixin, Tracing, APIView):
    permission_classes = [AllowAny]
    idempotency_allow_anonymous = True

    def post(self, request: Request) -> Response:
        TRACE.append("post")
        status, payload = perform(request.data)
        return Response(payload, status=status)


class GroupSerializer(serializers.ModelSerializer[Group]):
    class Meta:
        model = Group
        fields = ["id", "name"]


class GroupViewSet(IdempotencyMixin, viewsets.ModelViewSet[Group]):
    permission_classes = [AllowAny, DenyObjectOnHeader]
    idempotency_allow_anonymous = True
    serializer_class = GroupSerializer
    queryset = Group.objects.all()

    def perform_create(self, serializer: Any) -> None:
        CALLS.hit(f"viewset:{serializer.validated_data['name']}")
        serializer.save()

    def perform_update(self, serializer: Any) -> None:
        CALLS.hit(f"viewset:{serializer.validated_data['name']}")
        serializer.save()

    @action(detail=True, methods=["post"])
    def rename(self, request: Request, pk: str) -> Response:
        group = self.get_object()
        CALLS.hit(f"viewset:{request.data['name']}")
        group.name = request.data["name"]
        group.save()
        return Response({"id": group.pk, "name": group.name, "nonce": uuid.uuid4().hex})


def tenant_principal(request: Any) -> str:
    """A principal callable: the tenant named by a header, whoever the user is."""
    return "tenant:" + request.headers.get("X-Tenant", "none")


def _plain(request: HttpRequest) -> HttpResponseBase:
    data: Any = request.POST.dict()
    if request.content_type == "application/json":
        # Bodies that are not a JSON object (tests send garbage on purpose) script nothing.
        try:
            data = json.loads(request.body or b"{}")
        except (ValueError, RecursionError):
            data = {}
    if not isinstance(data, Mapping):
        data = {}
    script = {**request.GET.dict(), **data}
    reject = script.get("reject")
    if reject:
        # Plain Django has no exception for a validation error: a view answers 4xx itself.
        CALLS.hit(str(script.get("tag")))
        if reject == "raise404":
            raise Http404("No such thing.")
        if reject == "forbidden":
            raise PermissionDenied
        status = 404 if reject == "notfound" else 400
        return JsonResponse({"error": reject}, status=status)
    status, payload = perform(script)
    response = special_body(script, payload) or JsonResponse(payload, status=status)
    response.status_code = status
    return shape(response, script)


# The Django test client does not enforce CSRF, but a live server (requests) would.
# Anonymous keys are meant on the test views that anonymous clients call (each test sends
# keys of its own); plain_identified is the view that did not opt in.
plain = csrf_exempt(idempotent(allow_anonymous=True)(_plain))
plain_identified = csrf_exempt(idempotent(_plain))
plain_required = csrf_exempt(idempotent(required=True, allow_anonymous=True)(_plain))
plain_put_only = csrf_exempt(idempotent(methods=["PUT"], allow_anonymous=True)(_plain))
plain_tenant = csrf_exempt(idempotent(principal=tenant_principal)(_plain))
plain_excluding = csrf_exempt(
    idempotent(exclude_fields=["client_ts", "meta.sent_at"], allow_anonymous=True)(_plain)
)


@csrf_exempt
@idempotent(allow_anonymous=True)
def plain_json_only(request: HttpRequest) -> HttpResponseBase:
    """A plain view that parses its body as JSON, whatever the content type says."""
    CALLS.hit("json-only")
    try:
        data = json.loads(request.body)
    except ValueError:
        return JsonResponse({"detail": "The body must be JSON."}, status=400)
    return JsonResponse({"got": data}, status=201)


# login_required outside: access control runs before the replay.
plain_login_required = csrf_exempt(login_required(idempotent(_plain)))


class TokenOnlyView(ScriptedView):
    """Open to anonymous clients, and authenticates by token only: a logged-in session
    cookie does not make its client known. Anonymous keys are not meant."""

    authentication_classes = [TokenAuthentication]
    idempotency_allow_anonymous = False


class AnonymousKeysView(TokenOnlyView):
    idempotency_allow_anonymous = True


plain_anonymous_keys = csrf_exempt(idempotent(allow_anonymous=True)(_plain))


def _iban(request: HttpRequest) -> JsonResponse:
    """An account's IBAN: what a replay must never hand to another client."""
    user = request.user
    CALLS.hit(f"iban:{user.pk}")
    return JsonResponse({"iban": f"DE89370400440532{user.pk:06d}", "owner": user.username})


def _iban_drf(request: Request) -> Response:
    user = request.user
    CALLS.hit(f"iban:{user.pk}")
    return Response({"iban": f"DE89370400440532{user.pk:06d}", "owner": user.username})


def token_required(view: Any) -> Any:
    """The test project's token authentication, read when a request comes: tests.support.views is
    also imported by settings without the payments app."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        from testproject.payments.views import authenticate

        return authenticate(request) or view(request, *args, **kwargs)

    return wrapper


def _token_api_view(view: Any) -> Any:
    return api_view(["POST"])(
        authentication_classes([TokenAuthentication])(permission_classes([IsAuthenticated])(view))
    )


# Clients known by an X-Api-Key header, as some APIs authenticate: nothing sets request.user.
API_KEYS = {"alice-key": "alice", "bob-key": "bob"}


def api_key_required(view: Any) -> Any:
    """The view's own authentication by ``X-Api-Key``: 401 without a known key."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        client = API_KEYS.get(request.headers.get("X-Api-Key", ""))
        if client is None:
            return JsonResponse({"detail": "Send a known X-Api-Key."}, status=401)
        request.api_client = client  # type: ignore[attr-defined]
        return view(request, *args, **kwargs)

    return wrapper


def api_client(request: Any) -> str:
    """A principal callable: the API client that api_key_required found."""
    return f"client:{request.api_client}"


def _created(request: HttpRequest) -> JsonResponse:
    client = getattr(request, "api_client", "?")
    return JsonResponse({"id": CALLS.hit(f"api-key:{client}"), "client": client}, status=201)


# @idempotent above the API-key check (the claim comes first: every client is anonymous),
# and the fix: below it, with a principal callable naming the client.
api_key_above = csrf_exempt(idempotent(api_key_required(_created)))
api_key_scoped = csrf_exempt(api_key_required(idempotent(principal=api_client)(_created)))

# Misplaced on purpose: @idempotent above the view's own authentication claims the key
# before anyone is authenticated, so every caller is the anonymous principal.
iban_above_token_required = csrf_exempt(idempotent(token_required(_iban)))
iban_above_api_view = idempotent(_token_api_view(_iban_drf))
# The same views, decorated as the docs say.
iban_below_token_required = csrf_exempt(token_required(idempotent(_iban)))
iban_below_api_view = _token_api_view(idempotent(_iban_drf))


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(idempotent(allow_anonymous=True), name="post")
class MethodDecoratedView(View):
    """A plain class-based view whose POST is idempotent."""

    def post(self, request: HttpRequest) -> HttpResponseBase:
        return _plain(request)


@method_decorator(idempotent, name="dispatch")
class DispatchDecoratedView(APIView):
    """Misplaced on purpose: dispatch() is where DRF authenticates."""

    def post(self, request: Request) -> Response:
        return Response({"posted": True})


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(idempotent(allow_anonymous=True), name="dispatch")
class DispatchDecoratedPlainView(View):
    """A plain class view that authenticates nowhere: idempotent on dispatch() is fine."""

    def post(self, request: HttpRequest) -> HttpResponseBase:
        return _plain(request)


@method_decorator(idempotent(methods=["PUT"]), name="put")
class MethodDecoratedAPIView(APIView):
    """A DRF view protected by method_decorator instead of the mixin."""

    permission_classes = [AllowAny]

    def put(self, request: Request) -> Response:
        return Response({"put": True})
