"""The one adapter between Django's request and the engine: ``RequestUnit`` reads the key,
principal and fingerprint, opens the unit of work, and turns its decisions into responses.

Over 400 lines as one concern: ``RequestUnit`` and the header rules of its answers (``Prefer``,
``Accept-Encoding``, the replayed and never-stored headers), sync and async."""

from __future__ import annotations

import functools
import logging
import time
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.core.handlers.asgi import ASGIRequest
from django.db import router
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.utils.cache import patch_vary_headers
from django.utils.crypto import constant_time_compare

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.engine import instrumentation
from django_idempotency.engine.errors import (
    IdempotencyError,
    Misconfigured,
    MissingKey,
    PrincipalMissing,
)
from django_idempotency.engine.keyless import KeylessWork
from django_idempotency.engine.unit import UnitOfWork, failing_closed, secret_required
from django_idempotency.engine.work import Decision, Refuse, Replay, Result, Run, Work, view_name
from django_idempotency.http.identity import (
    ANONYMOUS,
    check_key,
    credentials_of,
    fingerprint_messages,
    parse_key,
    principal_for,
)
from django_idempotency.http.options import Policy
from django_idempotency.http.problems import problem_response
from django_idempotency.models import IdempotencyRecord

logger = logging.getLogger("django_idempotency")
# A request of the deployment probe's (``manage.py idempotency_probe --endpoint``): with the
# probe token, a protected view's checks run (key, principal, the fingerprint against the
# key's stored one, DRF's object permissions) and the answer is 204 without a claim: the
# view never runs.
PROBE_HEADER = "Idempotency-Probe"
PROBE_PRINCIPAL_HEADER = "Idempotency-Probe-Principal"


class Probed:
    """The answer to a probe request that passed the view's checks; ``anonymous``: its key
    would be claimed under the anonymous principal (a view with ``allow_anonymous``)."""

    def __init__(self, *, anonymous: bool = False) -> None:
        self.anonymous = anonymous


def is_probe_token(given: str | None) -> bool:
    """Whether ``given`` is IDEMPOTENCY_PROBE_TOKEN (never, while that is unset)."""
    token = conf.PROBE_TOKEN
    return bool(token and given) and constant_time_compare(given or "", token or "")


Answer = Decision | Probed

REPLAYED_HEADER = "Idempotent-Replayed"
# Response headers worth replaying; conf.REPLAY_HEADERS adds to these. The caching ones
# matter: a replayed access token must stay "no-store".
REPLAY_HEADERS = frozenset(
    (
        "content-type",
        "location",
        "content-language",
        "etag",
        "link",
        "cache-control",
        "expires",
        "pragma",
        "vary",
    )
)
# Never stored, whatever the settings say.
NEVER_STORED_HEADERS = frozenset(
    (
        "set-cookie",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "cookie",
    )
)
# "wait" preferences are capped before they become a timedelta: any number of digits.
MAX_PREFERRED_WAIT = 86400


def accepts_coding(header: str, coding: str) -> bool:
    """Whether an Accept-Encoding value allows ``coding`` (explicitly or by "*")."""
    allowed: dict[str, bool] = {}
    for item in header.lower().split(","):
        name, _, params = item.partition(";")
        quality = params.strip().removeprefix("q=").strip() if params else "1"
        try:
            allowed[name.strip()] = float(quality) > 0
        except ValueError:
            allowed[name.strip()] = False
    return allowed.get(coding, allowed.get("*", False))


def prefer_wait(meta: dict[str, Any]) -> int | None:
    """The ``wait`` preference of RFC 7240, in seconds; ill-formed preferences are ignored."""
    for preference in meta.get("HTTP_PREFER", "").split(","):
        token = preference.split(";", 1)[0]
        name, eq, value = token.partition("=")
        value = value.strip().strip('"')
        if name.strip().lower() == "wait" and eq and value.isascii() and value.isdigit():
            return int(value)
    return None


class RequestUnit:
    """The unit of work of one HTTP request: the view glue's only partner.

    ``covered`` says whether the request is subject to idempotency at all (its method,
    and a key or a view that requires one); ``open()`` decides, ``close(response)`` stores
    the response and returns what to send, ``fail(exc)`` rolls back.
    """

    def __init__(
        self, request: HttpRequest, policy: Policy, *, sender: Any, model: Any = None
    ) -> None:
        self.request = request
        self.policy = policy
        self.sender = sender
        # The model the view writes, if the glue knows it: its records go where it goes.
        self.model = model
        # A duplicate's wait counts from its arrival, not from the claim.
        self.arrived = time.monotonic()
        # A key_from view's key is read only in open(), after the view's own checks.
        protected = request.method in policy.methods
        self.covered = protected and (
            policy.required or policy.key_from is not None or policy.header_meta in request.META
        )
        # A protected method without a key runs in a transaction too (the outbox needs one),
        # with nothing claimed or stored; open() begins it.
        self.keyless = protected and not self.covered
        self._unit: UnitOfWork | None = None
        self._keyless: KeylessWork | None = None
        self._headers: dict[str, str] = {}

    def open(self, *, principal_request: Any = None, media_type: str | None = None) -> Answer:
        """Claim the key, or say how to answer instead. ``principal_request`` is the
        request that carries the authenticated user (DRF's), ``media_type`` the
        negotiated one when the view can answer in several. A duplicate that may wait
        waits here, on this thread, within the process's waiter cap.

        ``Run`` with nothing claimed when the request has no key (a key header, or what the
        view's ``key_from`` reads) and the view does not require one: the request runs in a
        transaction of its own, with nothing stored."""
        if self.keyless:
            return self._run_keyless()
        unit = self._unit_or_refusal(principal_request, media_type)
        if isinstance(unit, Refuse | Run | Probed):
            return unit
        try:
            decision = unit.open()
        except IdempotencyError as error:
            return self._refuse(error)
        return self._decided(decision)

    async def aopen(
        self, *, principal_request: Any = None, media_type: str | None = None
    ) -> Answer:
        """``open()`` for an async view: a duplicate that may wait sleeps on the event loop
        between claims, holding no thread and no database connection (under ASGI)."""
        if self.keyless:
            # On the request's one sync thread, where the view's async ORM calls run.
            return await sync_to_async(self._run_keyless)()
        unit = await sync_to_async(self._unit_or_refusal)(principal_request, media_type)
        if isinstance(unit, Refuse | Run | Probed):
            return unit
        # Under WSGI the event loop runs for a server thread that waits for it.
        holds_thread = not isinstance(self.request, ASGIRequest)
        try:
            decision = await unit.aopen(holds_thread=holds_thread)
        except IdempotencyError as error:
            return self._refuse(error)
        return self._decided(decision)

    def _unit_or_refusal(
        self, principal_request: Any, media_type: str | None
    ) -> UnitOfWork | Refuse | Run | Probed:
        try:
            unit = self._unit = self._prepare(principal_request or self.request, media_type)
        except IdempotencyError as error:
            instrumentation.refused(self.sender, error)
            return self._refuse(error)
        if unit is None:
            return self._run_keyless()
        if self._probing():
            self._unit = None  # nothing was claimed: nothing to close
            try:
                refused = unit.probe()
            except IdempotencyError as error:
                return self._refuse(error)
            if refused is not None:
                return self._refuse(refused.error)
            return Probed(anonymous=unit.work.principal == ANONYMOUS)
        return unit

    def _run_keyless(self) -> Run:
        work = self._keyless = KeylessWork(self._database(), self.sender)
        work.open()
        return Run()

    def _probing(self) -> bool:
        return is_probe_token(self.request.headers.get(PROBE_HEADER))

    def _decided(self, decision: Decision) -> Decision:
        if isinstance(decision, Refuse):
            return self._refuse(decision.error)
        return decision

    def _refuse(self, error: IdempotencyError) -> Refuse:
        error.headers.update(self._headers)
        return Refuse(error)

    def _prepare(self, principal_request: Any, media_type: str | None) -> UnitOfWork | None:
        request, policy = self.request, self.policy
        if policy.key_from is not None:
            found = policy.key_from(request)
            if found is None:
                if policy.required:
                    raise MissingKey("This endpoint requires a key, and the request has none.")
                return None
            key = check_key(found, "key read from the request")
        else:
            raw = request.META.get(policy.header_meta)
            if raw is None:
                raise MissingKey(f"This endpoint requires an {policy.header} header.")
            key = parse_key(raw)
        using = self._database()
        try:
            # The user may be loaded from the database only now, and the database's secret
            # (which keys a principal stored as a digest) read the first time.
            with failing_closed(), secret_required(self.sender):
                principal = principal_for(principal_request, policy.principal, using)
                if principal == ANONYMOUS and not policy.allow_anonymous:
                    raise self._anonymous(credentials_of(request))
        except PrincipalMissing:
            logger.error(
                "The principal callable of view %s returned no principal; the request was "
                "refused rather than run in a scope shared with others.",
                view_name(self.sender),
            )
            raise
        messages = fingerprint_messages(
            request, policy.exclude_fields, policy.fingerprint_headers, media_type=media_type
        )
        wait = policy.wait
        if wait > timedelta(0):
            # A client may ask for a shorter or longer wait only where waiting is on.
            preferred = prefer_wait(request.META)
            if preferred is not None:
                wait = timedelta(seconds=min(preferred, MAX_PREFERRED_WAIT))
            wait = min(wait, conf.MAX_WAIT)
            if preferred is not None:
                self._headers["Preference-Applied"] = f"wait={int(wait.total_seconds())}"
            wait -= timedelta(seconds=time.monotonic() - self.arrived)
        work = Work(
            principal=principal,
            key=key,
            method=request.method or "",
            path=request.path,
            fingerprint={},  # keyed by the unit when it opens
            ttl=policy.ttl,
            version=policy.version,
            rerun_other_versions=policy.rerun_other_versions,
            messages=messages,
        )
        return UnitOfWork(
            work,
            wait=wait,
            sender=self.sender,
            context=request,
            using=using,
            lookup_first=policy.lookup_first,
            poll=True,
        )

    def _anonymous(self, carried: str | None) -> Misconfigured:
        """The refusal of a keyed request whose principal is the anonymous one, on a view
        that did not opt in: whatever it carries (an API key header is as invisible here as
        none), every such caller would share one scope and replay each other's responses."""
        request = self.request
        logger.error(
            "The idempotent view %s (%s %s) got a key from a request whose principal is the "
            "anonymous one%s; the request was refused, since every anonymous caller would "
            "share one scope and replay each other's responses. Authenticate before the "
            "claim (put @idempotent below the view's authentication decorator, below "
            "@api_view for DRF, and let it set request.user), or give the view a principal "
            "callable (principal= / idempotency_principal / IDEMPOTENCY_PRINCIPAL) that "
            "scopes its clients, such as by API client; or set allow_anonymous=True on a "
            "view whose keys are meant to be anonymous (a receiver scoped by its key).",
            view_name(self.sender),
            request.method,
            request.path,
            "" if carried is None else f" although it carries {carried}",
        )
        carries = "" if carried is None else f" (the request carries {carried})"
        return Misconfigured(
            "This endpoint takes idempotency keys only from identified clients, and it had "
            f"not identified this request's client when it read the key{carries}, so the "
            "request was not processed."
        )

    def _database(self) -> str:
        """Where the records of this request live: the view's write database, so that the
        claim, the view's writes and the record commit together (per shard)."""
        using = self.policy.using
        if callable(using):
            return using(self.request)
        if using is not None:
            return using
        return router.db_for_write(self.model or IdempotencyRecord)

    def close(self, response: HttpResponseBase) -> HttpResponseBase:
        """Store the response and commit; the response to send (a problem when the work
        did not commit)."""
        unit = self._unit
        if unit is None:
            return self._close_keyless(response)
        try:
            result = _result(response)
        except BaseException as exc:
            unit.fail(exc)
            raise
        try:
            stored = unit.close(result)
        except IdempotencyError as error:
            return self.respond(self._refuse(error))
        for name, value in self._headers.items():
            response[name] = value
        if stored:
            signals.response_stored.send_robust(
                self.sender,
                request=self.request,
                key=unit.work.key,
                principal=unit.work.principal,
                status=response.status_code,
            )
        return response

    def _close_keyless(self, response: HttpResponseBase) -> HttpResponseBase:
        work, self._keyless = self._keyless, None
        if work is None:
            return response
        try:
            work.close(response.status_code)
        except IdempotencyError as error:
            return self.respond(self._refuse(error))
        return response

    def answer_for(self, decision: Answer) -> HttpResponse | None:
        """None after ``Run``: the view runs; else the response to send instead."""
        return None if isinstance(decision, Run) else self.respond(decision)

    def respond(self, decision: Replay | Refuse | Probed) -> HttpResponse:
        """The response to send instead of running the view: the replay, the refusal, or a
        probe's answer."""
        if isinstance(decision, Probed):
            response = HttpResponse(status=204)
            response[PROBE_HEADER] = "passed"
            # The probe's client reports an anonymous claim when it sent credentials.
            response[PROBE_PRINCIPAL_HEADER] = "anonymous" if decision.anonymous else "identified"
            return response
        if isinstance(decision, Replay):
            coding = decision.content_coding
            accepted = coding is not None and accepts_coding(
                self.request.headers.get("accept-encoding", ""), coding
            )
            return replay_response(decision, accepted, self._headers)
        return problem_response(decision.error)

    def fail(self, exc: BaseException) -> HttpResponse | None:
        """Roll back everything (the view raised); explain a durable block. The answer to
        send instead of the view's exception, when there is one: a lost connection's 503."""
        unit = self._unit
        if unit is None:
            work, self._keyless = self._keyless, None
            if work is not None:
                work.fail(exc)
                self._explain_durable(exc)
            return None
        self._unit = None
        try:
            unit.fail(exc)
        except BaseException as raised:
            # Ending the transaction on a lost connection raises a database error again;
            # then the lost connection decides the answer, and anything else goes on up.
            lost = unit.lost_store(raised) or unit.lost_store(exc)
            if lost is None:
                raise
        else:
            lost = unit.lost_store(exc)
        if lost is not None:
            logger.warning(
                "The database connection was lost during %s; answered 503 store-unavailable.",
                view_name(self.sender),
            )
            return self.respond(Refuse(lost))
        self._explain_durable(exc)
        return None

    def _explain_durable(self, exc: BaseException) -> None:
        if isinstance(exc, RuntimeError) and "durable atomic block" in str(exc):
            raise ImproperlyConfigured(
                f"The idempotent view {view_name(self.sender)} opens "
                "transaction.atomic(durable=True), "
                "which cannot run inside the request's transaction (the one that holds the "
                "key, or a keyless request's). Use a plain transaction.atomic() in this view."
            ) from exc


def lost_or_raise(exc: BaseException, lost: HttpResponse | None) -> HttpResponse:
    """What to send instead of the view's exception once ``fail(exc)`` rolled back: the
    lost store's answer it returned, else the exception, raised again."""
    if lost is None:
        raise exc
    return lost


@instrumentation.traced_replay
def replay_response(replay: Replay, accepted: bool, headers: dict[str, str]) -> HttpResponse:
    """The stored response, byte for byte (after decoding, unless the client ``accepted``
    the content coding of its compression), marked as a replay, with the request's own
    ``headers``."""
    coding = replay.content_coding if accepted else None
    body = replay.sent_body() if coding is None else replay.body
    response = HttpResponse(body, status=replay.status)
    del response["Content-Type"]
    for name, value in replay.headers:
        response[name] = value
    if coding is not None:
        # zlib's format is HTTP's "deflate", zstd's frame HTTP's "zstd": the client decodes
        # what we never decompress.
        response["Content-Encoding"] = coding
        patch_vary_headers(response, ("Accept-Encoding",))
    response[REPLAYED_HEADER] = "true"
    for name, value in headers.items():
        response[name] = value
    return response


def _result(response: HttpResponseBase) -> Result:
    if response.streaming:
        raise ImproperlyConfigured(
            "An idempotent view returned a streaming response, which cannot be stored for "
            "replay. Return a regular response from this view."
        )
    render = getattr(response, "render", None)
    if render is not None and not getattr(response, "is_rendered", True):
        render()
    kept = _kept_headers(conf.REPLAY_HEADERS)
    headers = [[name, value] for name, value in response.items() if name.lower() in kept]
    return Result(response.status_code, headers, response.content)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=16)
def _kept_headers(extra: tuple[str, ...]) -> frozenset[str]:
    """The response headers to store, for the setting's value: built once, not per request."""
    return REPLAY_HEADERS.union(name.lower() for name in extra) - NEVER_STORED_HEADERS
