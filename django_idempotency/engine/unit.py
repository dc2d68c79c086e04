"""What to do with a key: claim it and run the view in one transaction, replay the stored
response, or refuse. Framework glue calls ``begin`` and then ``Execution.finish``."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase

from django_idempotency import signals
from django_idempotency.conf import PrincipalFunc, conf
from django_idempotency.engine.errors import (
    IdempotencyError,
    InProgress,
    KeyExpired,
    KeyReused,
    MissingKey,
    StoreUnavailable,
)
from django_idempotency.engine.identity import differing, fingerprint, parse_key, principal_for
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import records as storage

logger = logging.getLogger("django_idempotency")

REPLAYED_HEADER = "Idempotent-Replayed"
# Response headers worth replaying; conf.REPLAY_HEADERS adds to these.
REPLAY_HEADERS = ("content-type", "location", "content-language", "etag", "link")
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
# A duplicate that gave up waiting is told to come back after this many seconds.
RETRY_AFTER_SECONDS = 1
_LOST_STORE = (OperationalError, InterfaceError)


@dataclass(frozen=True)
class Options:
    """The per-request policy: a view's overrides over the global settings."""

    methods: frozenset[str]
    required: bool
    ttl: timedelta
    wait: timedelta
    exclude_fields: tuple[str, ...]
    fingerprint_headers: tuple[str, ...]
    principal: PrincipalFunc | None

    @classmethod
    def resolve(
        cls,
        *,
        methods: Iterable[str] | None = None,
        required: bool | None = None,
        ttl: timedelta | None = None,
        wait: timedelta | None = None,
        exclude_fields: Iterable[str] | None = None,
        fingerprint_headers: Iterable[str] | None = None,
        principal: PrincipalFunc | None = None,
    ) -> Options:
        return cls(
            methods=conf.METHODS if methods is None else frozenset(m.upper() for m in methods),
            required=conf.REQUIRED if required is None else required,
            # The maximum decides when partitions are dropped, so no view may outlive it.
            ttl=min(conf.TTL if ttl is None else ttl, conf.MAX_TTL),
            wait=conf.WAIT if wait is None else wait,
            exclude_fields=tuple(exclude_fields or ()),
            fingerprint_headers=conf.FINGERPRINT_HEADERS
            if fingerprint_headers is None
            else tuple(fingerprint_headers),
            principal=principal if principal is not None else conf.PRINCIPAL,
        )


def prefer_wait(request: HttpRequest) -> int | None:
    """The ``wait`` preference of RFC 7240, in seconds; ill-formed preferences are ignored."""
    for preference in request.headers.get("Prefer", "").split(","):
        token = preference.split(";", 1)[0]
        name, eq, value = token.partition("=")
        value = value.strip().strip('"')
        if name.strip().lower() == "wait" and eq and value.isascii() and value.isdigit():
            return int(value)
    return None


def store_unavailable(detail: str) -> StoreUnavailable:
    error = StoreUnavailable(detail)
    error.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return error


@contextmanager
def failing_closed() -> Iterator[None]:
    """Turn a lost database connection into 503 store-unavailable: the view does not run
    unprotected, and the client is told to retry."""
    try:
        yield
    except _LOST_STORE as exc:
        raise store_unavailable(
            "The idempotency store is unavailable, so the request was not processed. "
            "Retry with the same key."
        ) from exc


def _short(key: str) -> str:
    # Logs never carry a whole key: keys can be guessable and are bearer-like.
    return key[:6] + "…" if len(key) > 6 else "…"


class Execution:
    """A claimed key with its transaction open: the view runs, then ``finish`` stores the
    response and commits, or ``abort`` rolls everything back."""

    def __init__(
        self,
        *,
        request: HttpRequest,
        sender: Any,
        using: str,
        stack: ExitStack,
        pending: storage.Pending,
        key: str,
        principal: str,
        extra_headers: dict[str, str],
    ) -> None:
        self.request = request
        self.sender = sender
        self.using = using
        self.pending = pending
        self.key = key
        self.principal = principal
        self._stack: ExitStack | None = stack
        self._extra_headers = extra_headers
        # Under ATOMIC_REQUESTS, DRF answers an exception with set_rollback(), meant to undo
        # the view's writes. A savepoint around the view gives it just that, and the 4xx is
        # still stored in the claim's transaction as it is without ATOMIC_REQUESTS.
        self._view_block: transaction.Atomic | None = None
        if connections[using].settings_dict.get("ATOMIC_REQUESTS"):
            self._view_block = transaction.atomic(using=using)
            self._view_block.__enter__()

    def finish(self, response: HttpResponseBase) -> HttpResponseBase:
        """Store the response (when its status is one we keep) and commit with the view's
        writes; a 5xx rolls everything back. Raises StoreUnavailable if the commit fails."""
        stack, self._stack = self._stack, None
        if stack is None:
            return response
        try:
            try:
                self._close_view_block((None, None, None))
                stored = self._store(response)
            except BaseException:
                self._rollback(stack, sys.exc_info())
                raise
            stack.close()
        except _LOST_STORE as exc:
            error = store_unavailable(
                "The response could not be committed; nothing was saved. Retry with the same key."
            )
            error.headers.update(self._extra_headers)
            raise error from exc
        for name, value in self._extra_headers.items():
            response[name] = value
        if stored:
            signals.response_stored.send_robust(
                self.sender,
                request=self.request,
                key=self.key,
                principal=self.principal,
                status=response.status_code,
            )
        return response

    def abort(self) -> None:
        """Roll back the claim and everything the view wrote (the view raised)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            self._rollback(stack, (None, None, None))

    def _close_view_block(self, exc_info: Any) -> None:
        block, self._view_block = self._view_block, None
        if block is not None:
            block.__exit__(*exc_info)

    def _rollback(self, stack: ExitStack, exc_info: Any) -> None:
        try:
            if self._view_block is not None:
                transaction.set_rollback(True, using=self.using)
                self._close_view_block(exc_info)
            transaction.set_rollback(True, using=self.using)
            stack.__exit__(*exc_info)
        except DatabaseError:
            # The connection is gone, and the server rolls back on its own.
            logger.warning("Rolling back an idempotent request failed", exc_info=True)

    def _store(self, response: HttpResponseBase) -> bool:
        # The view broke the transaction (a database error it caught, or DRF's
        # set_rollback under ATOMIC_REQUESTS): nothing can be written, all rolls back.
        if transaction.get_rollback(using=self.using):
            return False
        if response.streaming:
            raise ImproperlyConfigured(
                "An idempotent view returned a streaming response, which cannot be stored "
                "for replay. Return a regular response from this view."
            )
        code = response.status_code
        # Not stored means the retry runs the view again, so nothing the view wrote may
        # stay either: an unstored outcome rolls back like a 5xx.
        if code >= 500 or code in conf.UNSTORED_STATUSES:
            transaction.set_rollback(True, using=self.using)
            return False
        render = getattr(response, "render", None)
        if render is not None and not getattr(response, "is_rendered", True):
            render()
        body: bytes = response.content  # type: ignore[attr-defined]
        if len(body) > conf.MAX_RESPONSE_BYTES:
            raise ImproperlyConfigured(
                f"An idempotent response of {len(body)} bytes exceeds "
                f"IDEMPOTENCY_MAX_RESPONSE_BYTES ({conf.MAX_RESPONSE_BYTES})."
            )
        storage.complete(
            self.using, self.pending, code=code, headers=_replay_headers(response), body=body
        )
        return True


def _replay_headers(response: HttpResponseBase) -> list[list[str]]:
    allowed = {*REPLAY_HEADERS, *(h.lower() for h in conf.REPLAY_HEADERS)}
    allowed -= NEVER_STORED_HEADERS
    return [[name, value] for name, value in response.items() if name.lower() in allowed]


def replay(record: storage.Record) -> HttpResponse:
    """The stored response, byte for byte, marked as a replay."""
    body = storage.decode_body(record.response_body, record.body_encoding)
    response = HttpResponse(body, status=record.response_code or 200)
    del response["Content-Type"]
    for name, value in record.response_headers or ():
        response[name] = value
    response[REPLAYED_HEADER] = "true"
    return response


def covers(request: HttpRequest, options: Options) -> bool:
    """Whether this request is subject to idempotency at all: method and key present."""
    return (request.method or "").upper() in options.methods and (
        options.required or conf.HEADER in request.headers
    )


def begin(
    request: HttpRequest,
    options: Options,
    *,
    sender: Any = None,
    principal_request: Any = None,
    arrived: float | None = None,
    now: datetime | None = None,
) -> Execution | HttpResponse | None:
    """Decide what happens to this request.

    Returns None when the request is not covered (method, or no key and none required),
    a replay response, or an ``Execution`` holding the claim. Raises IdempotencyError.
    ``arrived`` (``time.monotonic()``) starts the duplicate's wait at its arrival.
    """
    if (request.method or "").upper() not in options.methods:
        return None
    raw = request.headers.get(conf.HEADER)
    if raw is None:
        if options.required:
            raise MissingKey(f"This endpoint requires an {conf.HEADER} header.")
        return None
    key = parse_key(raw)
    with failing_closed():  # the user may be loaded from the database only now
        principal = principal_for(principal_request or request, options.principal)
    parts = fingerprint(request, options.exclude_fields, options.fingerprint_headers)

    preferred = prefer_wait(request)
    # Capped before it becomes a timedelta: a client may send any number of digits.
    asked = options.wait if preferred is None else timedelta(seconds=min(preferred, 86400))
    wait = min(asked, conf.MAX_WAIT)
    extra_headers = (
        {"Preference-Applied": f"wait={int(wait.total_seconds())}"} if preferred is not None else {}
    )
    if arrived is not None:
        wait -= timedelta(seconds=time.monotonic() - arrived)

    using = router.db_for_write(IdempotencyRecord)
    started = time.monotonic()
    try:
        with failing_closed():
            stack, claimed = _claim(using, key, principal, request, parts, options, wait, now)
    except IdempotencyError as exc:
        exc.headers.update(extra_headers)
        raise
    context = {"key": key, "principal": principal}

    if claimed.outcome == storage.WON:
        assert claimed.pending is not None
        return Execution(
            request=request,
            sender=sender,
            using=using,
            stack=stack,
            pending=claimed.pending,
            extra_headers=extra_headers,
            **context,
        )
    with failing_closed():
        stack.close()  # nothing was written; ends the transaction and frees the lock
    record = claimed.record
    error: IdempotencyError
    if claimed.outcome == storage.BUSY or (record and record.status != 1):
        waited = time.monotonic() - started
        logger.info("Idempotency key %s is in progress; gave up after %.2fs", _short(key), waited)
        signals.request_conflicted.send_robust(sender, request=request, waited=waited, **context)
        error = InProgress(
            "A request with this Idempotency-Key is still being processed. Retry later with "
            "the same key."
        )
        error.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    elif claimed.outcome == storage.EXPIRED:
        error = KeyExpired(
            "This Idempotency-Key has expired; its outcome can no longer be replayed. Check "
            "whether the first request took effect before retrying with a new key."
        )
    else:
        assert record is not None
        changed = differing(record.fingerprint, parts)
        if not changed:
            response = replay(record)
            for name, value in extra_headers.items():
                response[name] = value
            logger.info("Replayed idempotency key %s", _short(key))
            signals.response_replayed.send_robust(
                sender, request=request, status=response.status_code, **context
            )
            return response
        logger.info("Idempotency key %s reused with different %s", _short(key), changed)
        signals.key_reused.send_robust(sender, request=request, differing=changed, **context)
        error = KeyReused(
            "This Idempotency-Key was already used for a different request. Use a new key "
            "for a new request.",
            differing=changed,
        )
    error.headers.update(extra_headers)
    raise error


def _claim(
    using: str,
    key: str,
    principal: str,
    request: HttpRequest,
    parts: dict[str, str],
    options: Options,
    wait: timedelta,
    now: datetime | None,
    retry: bool = True,
) -> tuple[ExitStack, storage.Claim]:
    stack = ExitStack()
    try:
        stack.enter_context(transaction.atomic(using=using))
        claimed = storage.claim(
            using,
            scope=principal,
            key=key,
            method=(request.method or "").upper(),
            path=request.path,
            fingerprint=parts,
            ttl=options.ttl,
            window=conf.MAX_TTL + conf.EXPIRED_WINDOW,
            gone=conf.EXPIRED_WINDOW,
            wait=max(wait, timedelta(0)),
            now=now,
        )
    except BaseException as exc:
        with suppress(DatabaseError):
            stack.__exit__(type(exc), exc, exc.__traceback__)
        if isinstance(exc, storage.PartitionMissing) and retry:
            # Maintenance has not run for days; make today's partition and claim again.
            logger.error("No partition for today's idempotency records; creating it now")
            storage.create_current_partition(using)
            return _claim(using, key, principal, request, parts, options, wait, now, False)
        if isinstance(exc, storage.PartitionMissing):
            raise store_unavailable("No partition accepts today's records.") from exc
        raise
    return stack, claimed
