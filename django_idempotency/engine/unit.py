"""What to do with a key: ``UnitOfWork`` claims it and runs the work in one transaction,
replays the stored outcome or refuses; ``RequestUnit`` is its adapter for an HTTP request."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.core.handlers.asgi import ASGIRequest
from django.db import InterfaceError, OperationalError, connections, router, transaction
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.utils.cache import patch_vary_headers

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.engine import instrumentation
from django_idempotency.engine.errors import (
    REPLAYED,
    WON,
    IdempotencyError,
    InProgress,
    KeyExpired,
    KeyReused,
    Misconfigured,
    MissingKey,
    PrincipalMissing,
    RolledBack,
    StoreUnavailable,
)
from django_idempotency.engine.hashing import claim_locks
from django_idempotency.engine.identity import (
    ANONYMOUS,
    check_key,
    credentials_of,
    differing,
    fingerprint,
    parse_key,
    principal_for,
)
from django_idempotency.engine.options import Policy
from django_idempotency.models import IdempotencyRecord
from django_idempotency.problems import problem_response
from django_idempotency.storage import bodies, riders
from django_idempotency.storage import records as storage
from django_idempotency.storage.secret import SecretMissing

logger = logging.getLogger("django_idempotency")

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
# A duplicate that gave up waiting is told to come back after this many seconds.
RETRY_AFTER_SECONDS = 1
# A waiting request tries the claim again after a pause that doubles from the first to the
# longest: a short holder is seen soon, a long one costs a few cheap claims a second.
FIRST_PAUSE = 0.05
LONGEST_PAUSE = 0.5
# "wait" preferences are capped before they become a timedelta: any number of digits.
MAX_PREFERRED_WAIT = 86400
_LOST_STORE = (OperationalError, InterfaceError)
GUNICORN_THREADS = re.compile(r"--threads[= ]+(\d+)")


def store_unavailable(detail: str) -> StoreUnavailable:
    error = StoreUnavailable(detail)
    error.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return error


@contextmanager
def failing_closed() -> Iterator[None]:
    """Turn a lost database connection into 503 store-unavailable: the work does not run
    unprotected, and the client is told to retry."""
    try:
        yield
    except _LOST_STORE as exc:
        raise store_unavailable(
            "The idempotency store is unavailable, so the request was not processed. "
            "Retry with the same key."
        ) from exc


def short(key: str) -> str:
    # Logs never carry a whole key: keys can be guessable and are bearer-like.
    return key[:6] + "…" if len(key) > 6 else "…"


class _Waiters:
    """How many requests of this process may wait for a holder on a thread of their own
    right now (sync views, and async views under WSGI): ``count``, capped so that waiting
    duplicates always leave a thread free for other requests. ``waiting``: the requests
    waiting now, async ones included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.waiting = 0

    def enter(self) -> bool:
        limit = waiter_limit()
        with self._lock:
            if self.count >= limit:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.count -= 1

    def slept(self, started: bool) -> bool:
        """Count a request that goes to sleep for the first time; True from then on."""
        if not started:
            with self._lock:
                self.waiting += 1
        return True

    def woke(self, started: bool) -> None:
        if started:
            with self._lock:
                self.waiting -= 1


def waiter_limit() -> int:
    """How many requests of this process may wait on a thread of their own at once."""
    if threading.current_thread() is threading.main_thread():
        # A process that serves requests on its main thread serves one at a time (gunicorn's
        # sync worker, uWSGI without threads): a waiting request would hold all of it.
        return 0
    limit = conf.MAX_WAITERS
    threads, _ = server_threads()
    if threads is not None:
        limit = min(limit, threads - 1)
    return max(limit, 0)


def server_threads() -> tuple[int | None, str]:
    """The request threads of one server process, and where that was learnt:
    IDEMPOTENCY_SERVER_THREADS, else gunicorn's ``--threads`` in GUNICORN_CMD_ARGS; None
    when neither says."""
    threads = conf.SERVER_THREADS
    if threads is not None:
        return threads, "IDEMPOTENCY_SERVER_THREADS"
    args = os.environ.get("GUNICORN_CMD_ARGS")
    if args is None:
        return None, ""
    found = GUNICORN_THREADS.search(args)
    # gunicorn's default is one thread (its sync worker).
    return (int(found.group(1)) if found else 1), "GUNICORN_CMD_ARGS"


waiters = _Waiters()


class _ErrorBudget:
    """How many 4xx each principal stored in this minute, in this process: past
    IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE a 4xx is answered but not stored.

    Per process, not in the database: the bound only keeps a client from filling the store
    with records of no effect, so an exact count across servers is not worth a query on
    every 4xx; the store holds at most the bound times the number of processes. Only the
    current minute is kept, so memory stays bounded by one minute's principals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._minute = -1
        self._counts: dict[str, int] = {}

    def take(self, principal: str) -> int:
        """Count one 4xx of ``principal``; how many it had this minute before this one."""
        minute = int(time.monotonic() // 60)
        with self._lock:
            if minute != self._minute:
                self._minute, self._counts = minute, {}
            count = self._counts.get(principal, 0)
            self._counts[principal] = count + 1
            return count


error_budget = _ErrorBudget()


# Decisions of open().


@dataclass(frozen=True, slots=True)
class Run:
    """The key is claimed: run the work, then ``close()``."""

    outcome: ClassVar[str] = WON


@dataclass(frozen=True, slots=True)
class Replay:
    """A stored outcome for the same work: answer with it; the work does not run."""

    record: storage.Record
    headers: dict[str, str] = field(default_factory=dict)
    # The client accepts the "deflate" coding: a compressed body goes out as stored.
    deflate: bool = False
    outcome: ClassVar[str] = REPLAYED

    @instrumentation.traced_replay
    def response(self) -> HttpResponse:
        """The stored response, byte for byte (after decoding), marked as a replay."""
        record = self.record
        encoded = self.deflate and record.body_encoding == bodies.ZLIB
        body = record.response_body if encoded else record.body()
        response = HttpResponse(body, status=record.response_code)
        del response["Content-Type"]
        for name, value in record.response_headers:
            response[name] = value
        if encoded:
            # zlib's format is HTTP's "deflate": the client decodes what we never inflate.
            response["Content-Encoding"] = "deflate"
            patch_vary_headers(response, ("Accept-Encoding",))
        response[REPLAYED_HEADER] = "true"
        for name, value in self.headers.items():
            response[name] = value
        return response


@dataclass(frozen=True, slots=True)
class Refuse:
    """The key cannot be used now (or ever, for this work): answer with the error."""

    error: IdempotencyError

    @property
    def outcome(self) -> str:
        return self.error.outcome

    def response(self) -> HttpResponse:
        return problem_response(self.error)


Decision = Run | Replay | Refuse


@dataclass(frozen=True, slots=True)
class Work:
    """What a unit of work claims: whose key, which key, and what was asked."""

    principal: str
    key: str
    method: str
    path: str
    fingerprint: dict[str, str]
    ttl: timedelta


# The unit whose work runs right now in this context (between Run and close/fail), for
# what derives from its identity and database: messaging.downstream.derive_key().
current_unit: ContextVar[UnitOfWork | None] = ContextVar("django_idempotency_unit", default=None)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the work produced, to store and replay."""

    status: int
    headers: list[list[str]]
    body: bytes


class UnitOfWork:
    """One key's claim, the work and its stored outcome, in one transaction.

    ``open()`` claims the key (waiting up to ``wait`` for a holder) and returns ``Run``,
    ``Replay`` or ``Refuse``. After ``Run``, the work runs inside the transaction, and
    ``close(outcome)`` stores it and commits, or ``fail(exc)`` rolls everything back.
    Under ``ATOMIC_REQUESTS`` the work runs in a savepoint of the request's transaction,
    so that DRF's ``set_rollback()`` undoes its writes while the 4xx is still stored.

    With ``poll`` (requests), a duplicate waits between claims that answer at once, with
    its connection given back, instead of inside the database's lock wait: ``open()``
    sleeps on its thread, within the process's waiter cap; ``aopen()`` sleeps on the event
    loop and holds neither a thread nor a connection while it does.
    """

    def __init__(
        self,
        work: Work,
        *,
        wait: timedelta,
        sender: Any = None,
        context: Any = None,
        using: str | None = None,
        lookup_first: bool = False,
        now: datetime | None = None,
        kind: str = "view",
        poll: bool = False,
    ) -> None:
        self.work = work
        self.wait = wait
        self.sender = sender
        # What signals carry as ``request``: the HTTP request, or a task's request.
        self.context = context
        self.using = using or router.db_for_write(IdempotencyRecord)
        self.lookup_first = lookup_first
        self.now = now
        # What the work is, for the logs: a "view", a "task".
        self.kind = kind
        self.poll = poll
        self._steps: Generator[Decision | None, Outcome | BaseException, bool]
        self._thread = 0
        self._thrown: BaseException | None = None
        self._started = 0.0
        self._deadline = 0.0
        self._pause = FIRST_PAUSE
        # Whether this unit holds one of the process's waiter slots (``waiters``).
        self._slot = False

    @instrumentation.traced_open
    def open(self) -> Decision:
        self._start()
        if not self.poll:
            # A consumer: its claim waits inside the database.
            decision = self._attempt(capped=None, wait=self.wait)
            assert decision is not None
            return decision
        slept = False
        try:
            while (decision := self._attempt(capped=True)) is None:
                slept = waiters.slept(slept)
                time.sleep(self._next_pause())
            return decision
        finally:
            waiters.woke(slept)
            self._leave()

    @instrumentation.traced_aopen
    async def aopen(self, *, holds_thread: bool = False) -> Decision:
        """``open()`` for an async view. Between claims the coroutine sleeps on the event
        loop; ``holds_thread``: the loop runs for a server thread that waits for it (an
        async view under WSGI), so the waiter cap applies."""
        self._start()
        slept = False
        try:
            # The claims run on the request's one sync thread (thread-sensitive), where a
            # won claim's transaction stays open for the view's ORM calls.
            while (decision := await sync_to_async(self._attempt)(holds_thread)) is None:
                slept = waiters.slept(slept)
                await asyncio.sleep(self._next_pause())
            return decision
        finally:
            waiters.woke(slept)
            self._leave()

    def _start(self) -> None:
        self._started = time.monotonic()
        self._deadline = self._started + self.wait.total_seconds()
        self._pause = FIRST_PAUSE

    def _next_pause(self) -> float:
        pause = min(self._pause, max(self._deadline - time.monotonic(), 0.0))
        self._pause = min(self._pause * 2, LONGEST_PAUSE)
        return pause

    def _attempt(self, capped: bool | None, wait: timedelta = timedelta(0)) -> Decision | None:
        """One claim: the decision, or None when another request holds the key and this
        one may wait and try again: it has time left, and, if it waits on a thread of its
        own (``capped``), a waiter slot. ``capped`` None: it never tries again."""
        self._thread = threading.get_ident()
        self._steps = self._transaction(capped, wait)
        return next(self._steps)

    def _may_wait(self, capped: bool | None) -> bool:
        if capped is None or time.monotonic() >= self._deadline:
            return False
        if capped and not self._slot:
            # Taken at the first busy claim, on the request's thread, and kept until open()
            # ends: a request that never waits never takes one.
            self._slot = waiters.enter()
        return self._slot or not capped

    def _leave(self) -> None:
        if self._slot:
            self._slot = False
            waiters.leave()

    @instrumentation.counted_close
    def close(self, outcome: Outcome) -> bool:
        """Store the outcome (when it is one we keep) and commit with the work's writes;
        an outcome not kept rolls everything back. Returns whether it was stored.
        Raises RolledBack when the work broke the transaction, StoreUnavailable when the
        commit fails."""
        return bool(self._finish(outcome))

    @instrumentation.counted_fail
    def fail(self, exc: BaseException) -> None:
        """Roll back the claim and everything the work wrote (the work raised)."""
        self._finish(exc)

    def _finish(self, result: Outcome | BaseException) -> bool | None:
        if self._thread != threading.get_ident():
            raise ImproperlyConfigured(
                "An idempotent unit of work was closed on another thread than the one that "
                "opened it, so the work did not run in the claim's transaction. Async views "
                "must reach the database through sync_to_async(thread_sensitive=True), which "
                "Django's async ORM does."
            )
        if isinstance(result, BaseException):
            self._thrown = result
        try:
            self._steps.send(result)
        except StopIteration as stop:
            return bool(stop.value)
        except BaseException as exc:
            if exc is result:
                return None
            raise
        raise AssertionError("the unit of work did not end")  # pragma: no cover

    def _transaction(
        self, capped: bool | None, wait: timedelta
    ) -> Generator[Decision | None, Outcome | BaseException, bool]:
        work = self.work
        # A consumer's records outlive MAX_TTL (IDEMPOTENCY_CONSUMER_TTL).
        window = max(conf.MAX_TTL, work.ttl) + conf.EXPIRED_WINDOW
        if self.lookup_first:
            with failing_closed():
                found = storage.lookup(
                    self.using, principal=work.principal, key=work.key, window=window
                )
            if found is not None:
                yield self._found(storage.Claimed(storage.Outcome.FOUND, record=found))
                return False
        with failing_closed():
            lock, fallback_locks = self._locks()
        outermost = not connections[self.using].in_atomic_block
        claimed: storage.Claimed | None = None
        try:
            with transaction.atomic(using=self.using):
                claimed = storage.claim(
                    self.using,
                    lock=lock,
                    principal=work.principal,
                    key=work.key,
                    window=window,
                    gone=conf.EXPIRED_WINDOW,
                    wait=wait,
                    now=self.now,
                    also_lock=fallback_locks,
                )
                if claimed.outcome is storage.Outcome.WON:
                    # set(), not a token's reset(): an async view closes the unit in
                    # another context than the one that opened it.
                    outer = current_unit.get()
                    current_unit.set(self)
                    try:
                        return (yield from self._run(claimed, outermost))
                    finally:
                        current_unit.set(outer)
        except storage.IsolationRefused as exc:
            raise self._misconfigured(exc) from exc
        except _LOST_STORE as exc:
            # The work's own exception goes back to the glue as it was; a connection lost
            # while ending the transaction means nothing was saved.
            if exc is self._thrown:
                raise
            if claimed is None:
                raise store_unavailable(
                    "The idempotency store is unavailable, so the request was not processed. "
                    "Retry with the same key."
                ) from exc
            raise store_unavailable(
                "The response could not be committed; nothing was saved. Retry with the same key."
            ) from exc
        # Not ours: the transaction ended above, which freed the lock at once.
        assert claimed is not None
        if claimed.outcome is storage.Outcome.BUSY:
            # A claim that does not wait finds the lock taken also while another duplicate
            # holds it for the moment its own claim takes to find the record: what is
            # committed is replayed, and only a key whose first request still runs is busy.
            with failing_closed():
                found = storage.lookup(
                    self.using, principal=work.principal, key=work.key, window=window
                )
            if found is not None:
                claimed = storage.Claimed(storage.Outcome.FOUND, record=found)
        if claimed.outcome is storage.Outcome.BUSY and self._may_wait(capped):
            self._release()
            yield None
            return False
        yield self._found(claimed, waited=time.monotonic() - self._started)
        return False

    def _locks(self) -> tuple[int, tuple[int, ...]]:
        work = self.work
        try:
            return claim_locks(self.using, work.principal, work.key)
        except SecretMissing as exc:
            # Never a fallback to SECRET_KEY: servers with different ones would not
            # serialise a key.
            logger.error("The idempotent %s was refused: %s", _name(self.sender), exc)
            raise Misconfigured(
                "The idempotency store of this server is not set up, so the request was not "
                "processed."
            ) from exc

    def _release(self) -> None:
        """Give the connection back while waiting (to the pool, if there is one), unless the
        request's own transaction (ATOMIC_REQUESTS) holds it."""
        connection = connections[self.using]
        if not connection.in_atomic_block:
            connection.close()

    def _run(
        self, claimed: storage.Claimed, outermost: bool
    ) -> Generator[Decision | None, Outcome | BaseException, bool]:
        using = self.using
        riding: list[tuple[str, list[Any]]] = []
        if connections[using].settings_dict.get("ATOMIC_REQUESTS"):
            with transaction.atomic(using=using):
                result = yield Run()
                if isinstance(result, BaseException):
                    raise result
                broken = storage.transaction_broken(using)
                if broken:
                    # Leave the savepoint by rolling back to it: the view's writes go, and
                    # the request's transaction can still store a 4xx.
                    transaction.set_rollback(True, using=using)
        else:
            # The transaction is the unit's own, so writes that can wait (an outbox row)
            # travel with the store and its COMMIT instead of a round trip each.
            with riders.riding(using, commits=outermost) as riding:
                result = yield Run()
            if isinstance(result, BaseException):
                raise result
            broken = storage.transaction_broken(using)
        if broken and 200 <= result.status < 400:
            transaction.set_rollback(True, using=using)
            logger.error(
                "An idempotent %s answered %s, but its transaction was marked for rollback, "
                "so nothing it did was committed; answered 500 instead. Catch database "
                "errors inside transaction.atomic() (a savepoint).",
                _name(self.sender, self.kind),
                result.status,
            )
            raise RolledBack(
                "The request's work was rolled back, so it did not take effect. Retry with "
                "the same key."
            )
        if broken and storage.transaction_broken(using):
            # A 4xx from a transaction that cannot commit: answered, not stored.
            transaction.set_rollback(True, using=using)
            return False
        if not self._keeps(result):
            # Not stored means the retry runs the work again, so nothing it wrote may
            # stay either.
            transaction.set_rollback(True, using=using)
            return False
        work = self.work
        assert claimed.created_at is not None
        body, encoding = bodies.encode_body(using, result.body, conf.COMPRESS_MIN_BYTES)
        finished = storage.Finished(
            principal=work.principal,
            key=work.key,
            method=work.method,
            path=work.path,
            fingerprint=work.fingerprint,
            created_at=claimed.created_at,
            expires_at=claimed.created_at + work.ttl,
            code=result.status,
            headers=result.headers,
            body=body,
            body_encoding=encoding,
        )
        try:
            storage.store(using, finished, row_id=claimed.row_id, commit=outermost, riders=riding)
        except _LOST_STORE:
            raise
        except Exception as exc:
            if not storage.missing_partition(exc):
                raise
            logger.critical(
                "No partition accepts today's idempotency records: partition maintenance "
                "has not run. Run `manage.py idempotency_partitions` now."
            )
            raise store_unavailable("No partition accepts today's records.") from exc
        return True

    def _misconfigured(self, refused: storage.IsolationRefused) -> Misconfigured:
        logger.error(
            "The idempotent %s was not run: its claim on database %r ran at isolation level "
            "%s, whose snapshot predates the key's lock and cannot see a duplicate's "
            "committed record. Run that database at READ COMMITTED: ALTER DATABASE/ALTER "
            "ROLE ... RESET default_transaction_isolation, no default_transaction_isolation "
            "in the connection's 'options', no 'isolation_level' in DATABASES OPTIONS.",
            _name(self.sender, self.kind),
            refused.using,
            refused.level.upper(),
        )
        return Misconfigured(
            "This deployment's database isolation level cannot keep the idempotency "
            "guarantee, so nothing was run. Retry with the same key once it is fixed."
        )

    def _keeps(self, result: Outcome) -> bool:
        code = result.status
        if code >= 500 or code in conf.UNSTORED_STATUSES:
            return False
        if code >= 400 and len(result.body) > conf.MAX_STORED_ERROR_BYTES:
            # A 4xx has no effect, so leaving its key free costs nothing; storing every
            # echo of a huge invalid body would.
            return False
        if code >= 400:
            limit = conf.MAX_STORED_ERRORS_PER_MINUTE
            seen = 0 if limit is None else error_budget.take(self.work.principal)
            if limit is not None and seen >= limit:
                # Likewise, a client cannot make the store keep a record per 4xx at any
                # rate: answered, not stored, and the key stays free. Logged once a minute.
                if seen == limit:
                    logger.warning(
                        "A principal of %s stored %d 4xx this minute; its further 4xx are "
                        "answered but not stored (IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE).",
                        _name(self.sender),
                        limit,
                    )
                return False
        if len(result.body) > conf.MAX_RESPONSE_BYTES:
            raise ImproperlyConfigured(
                f"An idempotent response of {len(result.body)} bytes exceeds "
                f"IDEMPOTENCY_MAX_RESPONSE_BYTES ({conf.MAX_RESPONSE_BYTES})."
            )
        return True

    def _found(self, claimed: storage.Claimed, waited: float = 0.0) -> Decision:
        work, record = self.work, claimed.record
        context = {"key": work.key, "principal": work.principal}
        if claimed.outcome is storage.Outcome.BUSY:
            logger.info(
                "Idempotency key %s is in progress; gave up after %.2fs", short(work.key), waited
            )
            signals.request_conflicted.send_robust(
                self.sender, request=self.context, waited=waited, **context
            )
            error: IdempotencyError = InProgress(
                "A request with this Idempotency-Key is still being processed. Retry later "
                "with the same key."
            )
            error.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
            return Refuse(error)
        if claimed.outcome is storage.Outcome.EXPIRED:
            return Refuse(
                KeyExpired(
                    "This Idempotency-Key has expired; its outcome can no longer be replayed. "
                    "Check whether the first request took effect before retrying with a new "
                    "key."
                )
            )
        assert record is not None
        changed = differing(record.fingerprint, work.fingerprint)
        if changed:
            logger.info("Idempotency key %s reused with different %s", short(work.key), changed)
            signals.key_reused.send_robust(
                self.sender, request=self.context, differing=changed, **context
            )
            return Refuse(
                KeyReused(
                    "This Idempotency-Key was already used for a different request. Use a new "
                    "key for a new request.",
                    differing=changed,
                )
            )
        logger.info("Replayed idempotency key %s", short(work.key))
        signals.response_replayed.send_robust(
            self.sender, request=self.context, status=record.response_code, **context
        )
        return Replay(record)


def _name(sender: Any, kind: str = "view") -> str:
    module = getattr(sender, "__module__", "")
    name = getattr(sender, "__qualname__", None) or repr(sender)
    return f"{kind} {module}.{name}" if module else f"{kind} {name}"


def accepts_deflate(header: str) -> bool:
    """Whether an Accept-Encoding value allows "deflate" (explicitly or by "*")."""
    allowed: dict[str, bool] = {}
    for item in header.lower().split(","):
        coding, _, params = item.partition(";")
        quality = params.strip().removeprefix("q=").strip() if params else "1"
        try:
            allowed[coding.strip()] = float(quality) > 0
        except ValueError:
            allowed[coding.strip()] = False
    return allowed.get("deflate", allowed.get("*", False))


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
        self.covered = request.method in policy.methods and (
            policy.required or policy.key_from is not None or policy.header_meta in request.META
        )
        self._unit: UnitOfWork | None = None
        self._headers: dict[str, str] = {}

    def open(self, *, principal_request: Any = None, media_type: str | None = None) -> Decision:
        """Claim the key, or say how to answer instead. ``principal_request`` is the
        request that carries the authenticated user (DRF's), ``media_type`` the
        negotiated one when the view can answer in several. A duplicate that may wait
        waits here, on this thread, within the process's waiter cap.

        ``Run`` with nothing claimed when the view's ``key_from`` found no key and the view
        does not require one: the request runs unprotected, as one without a key header."""
        unit = self._unit_or_refusal(principal_request, media_type)
        if isinstance(unit, Refuse | Run):
            return unit
        try:
            decision = unit.open()
        except IdempotencyError as error:
            return self._refuse(error)
        return self._decided(decision)

    async def aopen(
        self, *, principal_request: Any = None, media_type: str | None = None
    ) -> Decision:
        """``open()`` for an async view: a duplicate that may wait sleeps on the event loop
        between claims, holding no thread and no database connection (under ASGI)."""
        unit = await sync_to_async(self._unit_or_refusal)(principal_request, media_type)
        if isinstance(unit, Refuse | Run):
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
    ) -> UnitOfWork | Refuse | Run:
        try:
            unit = self._unit = self._prepare(principal_request or self.request, media_type)
        except IdempotencyError as error:
            instrumentation.refused(self.sender, error)
            return self._refuse(error)
        if unit is None:
            return Run()
        return unit

    def _decided(self, decision: Decision) -> Decision:
        if isinstance(decision, Refuse):
            return self._refuse(decision.error)
        if isinstance(decision, Replay):
            deflate = accepts_deflate(self.request.META.get("HTTP_ACCEPT_ENCODING", ""))
            return Replay(decision.record, self._headers, deflate)
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
        try:
            with failing_closed():  # the user may be loaded from the database only now
                principal = principal_for(principal_request, policy.principal)
                carried = (
                    credentials_of(request)
                    if principal == ANONYMOUS and not policy.allow_anonymous
                    else None
                )
        except PrincipalMissing:
            logger.error(
                "The principal callable of %s returned no principal; the request was "
                "refused rather than run in a scope shared with others.",
                _name(self.sender),
            )
            raise
        if carried is not None:
            logger.error(
                "The idempotent %s (%s %s) got a key from a request that carries %s, but "
                "whose principal is the anonymous one: the key is claimed before the view's "
                "own authentication runs, so every caller would share one scope and replay "
                "each other's responses; the request was refused. Put @idempotent below the "
                "view's authentication decorator (below @api_view for DRF), or set "
                "allow_anonymous=True on a view whose keys are meant to be anonymous (a "
                "receiver scoped otherwise).",
                _name(self.sender),
                request.method,
                request.path,
                carried,
            )
            raise Misconfigured(
                f"The request carries {carried}, but this endpoint claimed its key before "
                "authenticating it, so the request was not processed."
            )
        parts = fingerprint(
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
            fingerprint=parts,
            ttl=policy.ttl,
        )
        return UnitOfWork(
            work,
            wait=wait,
            sender=self.sender,
            context=request,
            using=self._database(),
            lookup_first=policy.lookup_first,
            poll=True,
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
        if unit is None:  # run unprotected: key_from found no key
            return response
        try:
            outcome = _outcome(response)
        except BaseException as exc:
            unit.fail(exc)
            raise
        try:
            stored = unit.close(outcome)
        except IdempotencyError as error:
            return self._refuse(error).response()
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

    def fail(self, exc: BaseException) -> None:
        """Roll back everything (the view raised); explain a durable block."""
        unit = self._unit
        if unit is None:
            return
        self._unit = None
        unit.fail(exc)
        if isinstance(exc, RuntimeError) and "durable atomic block" in str(exc):
            raise ImproperlyConfigured(
                f"The idempotent {_name(self.sender)} opens transaction.atomic(durable=True), "
                "which cannot run inside the request's transaction that holds the key. Use a "
                "plain transaction.atomic() in this view."
            ) from exc


def _outcome(response: HttpResponseBase) -> Outcome:
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
    return Outcome(response.status_code, headers, response.content)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=16)
def _kept_headers(extra: tuple[str, ...]) -> frozenset[str]:
    """The response headers to store, for the setting's value: built once, not per request."""
    return REPLAY_HEADERS.union(name.lower() for name in extra) - NEVER_STORED_HEADERS
