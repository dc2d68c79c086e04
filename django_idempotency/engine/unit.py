"""The unit of work: one key's claim, the work and its stored result, in one transaction;
``failing_closed`` turns a lost store into a refusal.

Over 400 lines as one concern: the claim, the waits, the run and the store of one key, sync and
async, are the steps of one transaction, read together."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import InterfaceError, OperationalError, connections, router, transaction

from django_idempotency.conf import conf
from django_idempotency.engine import instrumentation, record
from django_idempotency.engine.decisions import decide, key_reused, unstale
from django_idempotency.engine.errors import (
    RETRY_AFTER_SECONDS,
    InProgress,
    Misconfigured,
    RolledBack,
    StoreUnavailable,
)
from django_idempotency.engine.hashing import SecretMismatch, claim_locks
from django_idempotency.engine.keeping import keeps
from django_idempotency.engine.waiting import Patience, waiters
from django_idempotency.engine.work import (
    Decision,
    Refuse,
    Result,
    Run,
    Work,
    view_name,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import records, riders, sealing
from django_idempotency.storage.secret import SecretMissing

logger = logging.getLogger("django_idempotency")

_LOST_STORE = (OperationalError, InterfaceError)


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


@contextmanager
def secret_required(sender: Any, kind: str = "view") -> Iterator[None]:
    """Refuse the work (``misconfigured``) when the database has no secret to key its locks
    and digests with: never a fallback to SECRET_KEY, since servers with different ones would
    neither serialise a key nor compare its fingerprints."""
    try:
        yield
    except SecretMissing as exc:
        logger.error("The idempotent %s was refused: %s", _name(sender, kind), exc)
        raise Misconfigured(
            "The idempotency store of this server is not set up, so the request was not processed."
        ) from exc
    except SecretMismatch as exc:
        # Never a lock of this server's own: another server could run the key meanwhile.
        logger.error("The idempotent %s was refused: %s", _name(sender, kind), exc)
        raise Misconfigured(
            "This server's idempotency secret is not its database's, so the request was "
            "not processed."
        ) from exc


def rolled_back(who: str, status: int, retry: str = "Retry.") -> RolledBack:
    """The refusal of a 2xx or 3xx whose transaction was marked for rollback, logged: the
    client is never told of work that did not commit (keyed or not)."""
    logger.error(
        "%s answered %s, but its transaction was marked for rollback, so nothing it did was "
        "committed; answered 500 instead. Catch database errors inside transaction.atomic() "
        "(a savepoint).",
        who,
        status,
    )
    return RolledBack(f"The request's work was rolled back, so it did not take effect. {retry}")


def _name(sender: Any, kind: str = "view") -> str:
    return f"{kind} {view_name(sender)}"


# The unit whose work runs right now in this context (between Run and close/fail), for
# what derives from its identity and database: messaging.downstream.derive_key().
current_unit: ContextVar[UnitOfWork | None] = ContextVar("django_idempotency_unit", default=None)


class UnitOfWork:
    """One key's claim, the work and its stored result, in one transaction.

    ``open()`` claims the key (waiting up to ``wait`` for a holder) and returns ``Run``,
    ``Replay`` or ``Refuse``. After ``Run``, the work runs inside the transaction, and
    ``close(result)`` stores it and commits, or ``fail(exc)`` rolls everything back.
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
        self._steps: Generator[Decision | None, Result | BaseException, bool]
        self._thread = 0
        self._thrown: BaseException | None = None
        self._patience = Patience(wait)
        self._ring: sealing.Keyring | None = None
        # The driver's connection the work ran on when it failed: whether it broke says why.
        self._failed_on: Any = None
        # The generation of the execution running now (its claim's), and how many messages
        # it has named so far: what a message id derived from the request is made of.
        self.generation = 0
        self._places = 0

    @instrumentation.traced_open
    def open(self) -> Decision:
        self._patience = patience = Patience(self.wait)
        if not self.poll:
            # A consumer: its claim waits inside the database.
            decision = self._attempt(capped=None, wait=self.wait)
            assert decision is not None
            return decision
        slept = False
        try:
            while (decision := self._attempt(capped=True)) is None:
                slept = waiters.slept(slept)
                time.sleep(patience.next_pause())
            return decision
        finally:
            waiters.woke(slept)
            patience.leave()

    @instrumentation.traced_aopen
    async def aopen(self, *, holds_thread: bool = False) -> Decision:
        """``open()`` for an async view. Between claims the coroutine sleeps on the event
        loop; ``holds_thread``: the loop runs for a server thread that waits for it (an
        async view under WSGI), so the waiter cap applies."""
        self._patience = patience = Patience(self.wait)
        slept = False
        try:
            # The claims run on the request's one sync thread (thread-sensitive), where a
            # won claim's transaction stays open for the view's ORM calls.
            while (decision := await sync_to_async(self._attempt)(holds_thread)) is None:
                slept = waiters.slept(slept)
                await asyncio.sleep(patience.next_pause())
            return decision
        finally:
            waiters.woke(slept)
            patience.leave()

    def _attempt(self, capped: bool | None, wait: timedelta = timedelta(0)) -> Decision | None:
        """One claim: the decision, or None when another request holds the key and this
        one may wait and try again: it has time left, and, if it waits on a thread of its
        own (``capped``), a waiter slot. ``capped`` None: it never tries again."""
        self._thread = threading.get_ident()
        self._steps = self._transaction(capped, wait)
        return next(self._steps)

    @instrumentation.counted_close
    def close(self, result: Result) -> bool:
        """Store the result (when it is one we keep) and commit with the work's writes;
        a result not kept rolls everything back. Returns whether it was stored.
        Raises RolledBack when the work broke the transaction, StoreUnavailable when the
        commit fails."""
        return bool(self._finish(result))

    @instrumentation.counted_fail
    def fail(self, exc: BaseException) -> None:
        """Roll back the claim and everything the work wrote (the work raised)."""
        self._failed_on = connections[self.using].connection
        self._finish(exc)

    def lost_store(self, exc: BaseException) -> StoreUnavailable | None:
        """The refusal to answer when the work failed because the connection to the store
        went away (a cut, a restart, a failover): nothing was saved and the key is free, so
        the client is told to retry rather than shown a server error. None otherwise."""
        if not isinstance(exc, _LOST_STORE):
            return None
        raw = self._failed_on
        if raw is not None and not (getattr(raw, "broken", False) or getattr(raw, "closed", 0)):
            return None  # the view's own database error (a deadlock, a timeout): its 500
        return store_unavailable(
            "The connection to the database was lost while the request ran; nothing was "
            "saved. Retry with the same key."
        )

    def _finish(self, result: Result | BaseException) -> bool | None:
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
    ) -> Generator[Decision | None, Result | BaseException, bool]:
        # Before anything is claimed: with keys that cannot seal, nothing may run.
        ring = self._ring = record.keyring(self.sender, self.kind)
        with failing_closed(), secret_required(self.sender, self.kind):
            work = self.work = self.work.keyed(self.using)
        # A consumer's records outlive MAX_TTL (IDEMPOTENCY_CONSUMER_TTL).
        window = max(conf.MAX_TTL, work.ttl) + conf.EXPIRED_WINDOW
        # Before the lookup: a server the claim would refuse (its secret is not the
        # database's) is refused before anything is replayed too.
        with failing_closed():
            lock, fallback_locks = self._locks()
        # Inside a transaction of the caller's (ATOMIC_REQUESTS), the lookup would follow
        # its BEGIN and save a replay nothing: the claim alone answers there.
        if self.lookup_first and not connections[self.using].in_atomic_block:
            # What the claim would answer "found" with, in one statement; a miss leaves
            # every other answer (busy, expired, stale, won) to the claim.
            found = self._lookup(window)
            if found is not None:
                stored = records.Claimed(records.Outcome.FOUND, record=found)
                yield decide(stored, work, sender=self.sender, context=self.context, ring=ring)
                return False
        outermost = not connections[self.using].in_atomic_block
        claimed: records.Claimed | None = None
        try:
            with transaction.atomic(using=self.using):
                claimed = records.claim(
                    self.using,
                    lock=lock,
                    principal=work.principal,
                    key=work.key,
                    window=window,
                    gone=conf.EXPIRED_WINDOW,
                    wait=wait,
                    now=self.now,
                    also_lock=fallback_locks,
                    version=work.version,
                    # After a lookup that found nothing, the claim wins but in a race.
                    opening=self.lookup_first,
                )
                if claimed.outcome is records.Outcome.STALE:
                    claimed = unstale(self.using, self.work, claimed)
                if claimed.outcome is records.Outcome.WON:
                    # set(), not a token's reset(): an async view closes the unit in
                    # another context than the one that opened it.
                    outer = current_unit.get()
                    current_unit.set(self)
                    try:
                        return (yield from self._run(claimed, outermost))
                    finally:
                        current_unit.set(outer)
        except records.IsolationRefused as exc:
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
        if claimed.outcome is records.Outcome.BUSY:
            # A claim that does not wait finds the lock taken also while another duplicate
            # holds it for the moment its own claim takes to find the record: what is
            # committed is replayed, and only a key whose first request still runs is busy.
            found = self._lookup(window)
            if found is not None:
                claimed = records.Claimed(records.Outcome.FOUND, record=found)
        if claimed.outcome is records.Outcome.BUSY and self._patience.may_wait(capped):
            self._release()
            yield None
            return False
        waited = time.monotonic() - self._patience.started
        yield decide(
            claimed, work, sender=self.sender, context=self.context, waited=waited, ring=ring
        )
        return False

    def probe(self) -> Refuse | None:
        """What a probe request of this work meets, with nothing claimed: ``Refuse`` when
        the key's stored record is another request's (a reused key, 422, as a real request
        would be answered); None when the key would be claimed, or replayed."""
        window = max(conf.MAX_TTL, self.work.ttl) + conf.EXPIRED_WINDOW
        found = self._lookup(window)
        with secret_required(self.sender, self.kind):
            work = self.work.keyed(self.using)
        changed = None if found is None else work.differing(found.fingerprint)
        return Refuse(key_reused(changed)) if changed else None

    def _lookup(self, window: timedelta) -> records.Record | None:
        """The key's stored record of this version, read without the lock, where the claim
        would replay it."""
        work = self.work
        try:
            with failing_closed():
                return records.lookup(
                    self.using, principal=work.principal, key=work.key, window=window,
                    version=work.version, now=self.now,
                )  # fmt: skip
        except records.IsolationRefused as exc:
            raise self._misconfigured(exc) from exc

    def _locks(self) -> tuple[int, tuple[int, ...]]:
        work = self.work
        with secret_required(self.sender, self.kind):
            return claim_locks(self.using, work.principal, work.key)

    def _release(self) -> None:
        """Give the connection back while waiting (to the pool, if there is one), unless the
        request's own transaction (ATOMIC_REQUESTS) holds it."""
        connection = connections[self.using]
        if not connection.in_atomic_block:
            connection.close()

    def _run(
        self, claimed: records.Claimed, outermost: bool
    ) -> Generator[Decision | None, Result | BaseException, bool]:
        using = self.using
        self.generation, self._places = claimed.generation, 0
        riding: list[tuple[str, list[Any]]] = []
        if connections[using].settings_dict.get("ATOMIC_REQUESTS"):
            with transaction.atomic(using=using):
                result = yield Run()
                if isinstance(result, BaseException):
                    raise result
                broken = records.transaction_broken(using)
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
            broken = records.transaction_broken(using)
        if broken and 200 <= result.status < 400:
            transaction.set_rollback(True, using=using)
            raise rolled_back(
                f"An idempotent {_name(self.sender, self.kind)}",
                result.status,
                "Retry with the same key.",
            )
        if broken and records.transaction_broken(using):
            # A 4xx from a transaction that cannot commit: answered, not stored.
            transaction.set_rollback(True, using=using)
            return False
        if not keeps(result, self.work.principal, self.sender, using):
            # Not stored means the retry runs the work again, so nothing it wrote may
            # stay either.
            transaction.set_rollback(True, using=using)
            return False
        finished = record.finished(using, self.work, result, claimed, self._ring)
        try:
            records.store(using, finished, row_id=claimed.row_id, commit=outermost, riders=riding)
        except _LOST_STORE:
            raise
        except Exception as exc:
            if records.second_execution(exc):
                raise self._second_execution() from exc
            if not records.missing_partition(exc):
                raise
            logger.critical(
                "No partition accepts today's idempotency records: partition maintenance "
                "has not run. Run `manage.py idempotency_partitions` now."
            )
            raise store_unavailable("No partition accepts today's records.") from exc
        return True

    def next_place(self) -> int:
        """The place of the next message the running work sends out (0, 1, …): an execution
        that runs again after a lost commit sends its messages in the same places."""
        place, self._places = self._places, self._places + 1
        return place

    def _second_execution(self) -> InProgress:
        """The answer to an execution that the database refused to commit: another one of
        the same key committed first, which the lock should have prevented. Everything it
        wrote rolls back; the client's retry gets the first one's answer."""
        logger.error(
            "A second execution of one key was refused by the database and rolled back: the "
            "idempotent %s ran while another execution of the same key did, which the key's "
            "lock should have prevented (two servers locking with different secrets?). "
            "Whatever it sent outside the database was sent twice.",
            _name(self.sender, self.kind),
        )
        refused = InProgress(
            "Another request with this Idempotency-Key completed first; this one was rolled "
            "back. Retry with the same key to receive its response."
        )
        refused.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return refused

    def _misconfigured(self, refused: records.IsolationRefused) -> Misconfigured:
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
