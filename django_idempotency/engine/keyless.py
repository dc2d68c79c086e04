"""A keyless request to a protected method of a protected view: nothing is claimed or stored,
but the view runs in a transaction, as a keyed request does, so that what it puts in the
outbox is published if and only if its writes commit (contract section 12)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from contextvars import ContextVar
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import InterfaceError, OperationalError, transaction

from django_idempotency.engine.unit import rolled_back
from django_idempotency.engine.work import view_name
from django_idempotency.storage import records

logger = logging.getLogger("django_idempotency")

# The keyless work whose view runs right now in this context: OutboxTask's calls go to the
# outbox in its transaction, as in a unit of work's.
current_keyless: ContextVar[KeylessWork | None] = ContextVar(
    "django_idempotency_keyless", default=None
)


class KeylessWork:
    """``open()`` begins the transaction on ``using`` (a savepoint under
    ``ATOMIC_REQUESTS``); ``close(status)`` commits it unless the answer is a 5xx, and
    ``fail(exc)`` rolls it back (the view raised)."""

    def __init__(self, using: str, sender: Any) -> None:
        self.using = using
        self.sender = sender
        self._thread = 0
        self._steps: Generator[None, int | BaseException, None] | None = None

    def open(self) -> None:
        self._thread = threading.get_ident()
        self._steps = self._transaction()
        try:
            next(self._steps)
        except (OperationalError, InterfaceError) as exc:
            # The records' database is out of reach (records kept apart from the view's
            # writes): nothing is claimed without a key, so the request runs as it would
            # without the app, with no transaction of ours, rather than being refused.
            self._steps = None
            logger.warning(
                "The records' database %r is unreachable, so the protected view %s runs a "
                "request without a key outside a transaction of ours (%s).",
                self.using,
                view_name(self.sender),
                exc,
            )

    def close(self, status: int) -> None:
        """Commit, or roll back a 5xx. Raises RolledBack for a 2xx or 3xx whose transaction
        was marked for rollback: the client is never told of work that did not commit."""
        self._finish(status)

    def fail(self, exc: BaseException) -> None:
        self._finish(exc)

    def _finish(self, outcome: int | BaseException) -> None:
        steps, self._steps = self._steps, None
        if steps is None:
            return
        if self._thread != threading.get_ident():
            raise ImproperlyConfigured(
                "A protected view's transaction was closed on another thread than the one "
                "that opened it. Async views must reach the database through "
                "sync_to_async(thread_sensitive=True), which Django's async ORM does."
            )
        try:
            steps.send(outcome)
        except StopIteration:
            return
        except BaseException as exc:
            if exc is outcome:
                return
            raise

    def _transaction(self) -> Generator[None, int | BaseException, None]:
        using = self.using
        with transaction.atomic(using=using):
            # set(), not a token's reset(): an async view closes the work in another context
            # than the one that opened it.
            outer = current_keyless.get()
            current_keyless.set(self)
            try:
                outcome = yield
            finally:
                current_keyless.set(outer)
            if isinstance(outcome, BaseException):
                raise outcome
            broken = records.transaction_broken(using)
            if outcome >= 500 or broken:
                transaction.set_rollback(True, using=using)
            if broken and 200 <= outcome < 400:
                raise rolled_back(
                    f"The protected view {view_name(self.sender)} (a request without a key)",
                    outcome,
                )
