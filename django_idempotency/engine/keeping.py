"""Which results a unit stores: not a 5xx, and a 4xx only within its size and its
principal's per-minute budget, counted in the records' database across every process."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.engine import instrumentation
from django_idempotency.engine.work import Result, view_name

logger = logging.getLogger("django_idempotency")


# Counted in the unit's transaction, so that a 4xx that is not committed is not counted; the
# row's lock serialises one principal's concurrent 4xx for the moment of their commits.
_COUNT = (
    "INSERT INTO django_idempotency_error_count (scope, minute, stored) VALUES (%s, %s, 1) "
    "ON CONFLICT (scope, minute) DO UPDATE "
    "SET stored = django_idempotency_error_count.stored + 1 RETURNING stored"
)
_FORGET = "DELETE FROM django_idempotency_error_count WHERE minute < %s"


class _ErrorBudget:
    """How many 4xx each principal stored in this minute: past
    IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE a 4xx is answered but not stored.

    Counted in the records' database (a row per principal and minute), so that the bound
    holds across every server process; a statement more, only for a 4xx that would be
    stored. Each process deletes the rows of past minutes once a minute."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        # Wall-clock minutes, shared by every process; a test fixes its own.
        self.clock = clock
        self._lock = threading.Lock()
        self._swept: dict[str, int] = {}
        # The principals this process reported past the bound, this minute.
        self._minute = -1
        self._reported: set[str] = set()

    def first_past(self, principal: str) -> bool:
        """Whether ``principal`` went past the bound for the first time this minute in this
        process: a 4xx that is not stored rolls its count back, so the count cannot say."""
        minute = int(self.clock() // 60)
        with self._lock:
            if minute != self._minute:
                self._minute, self._reported = minute, set()
            first = principal not in self._reported
            self._reported.add(principal)
            return first

    def take(self, using: str, principal: str) -> int:
        """Count one 4xx of ``principal``; how many it had this minute before this one."""
        minute = int(self.clock() // 60)
        with self._lock:
            sweep = self._swept.get(using) != minute
            self._swept[using] = minute
        # Django's own cursor, on every database: this path is taken only by a 4xx.
        with connections[using].cursor() as cursor:
            if sweep:
                cursor.execute(_FORGET, [minute - 1])
            cursor.execute(_COUNT, [principal, minute])
            row = cursor.fetchone()
        assert row is not None
        return int(row[0]) - 1


error_budget = _ErrorBudget()


def keeps(result: Result, principal: str, sender: Any, using: str) -> bool:
    """Whether a result is stored (else everything the work wrote is rolled back): not a
    5xx or an unstored status, nor a 4xx past its size or its principal's budget."""
    code = result.status
    if code >= 500 or code in conf.UNSTORED_STATUSES:
        return False
    if code >= 400 and len(result.body) > conf.MAX_STORED_ERROR_BYTES:
        # A 4xx has no effect, so leaving its key free costs nothing; storing every
        # echo of a huge invalid body would.
        return False
    if code >= 400:
        limit = conf.MAX_STORED_ERRORS_PER_MINUTE
        seen = 0 if limit is None else error_budget.take(using, principal)
        if limit is not None and seen >= limit:
            # Likewise, a client cannot make the store keep a record per 4xx at any
            # rate: answered, not stored, and the key stays free. Logged, counted and
            # signalled once a minute per principal and process.
            if error_budget.first_past(principal):
                logger.warning(
                    "A principal of view %s stored %d 4xx this minute; its further 4xx are "
                    "answered but not stored (IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE).",
                    view_name(sender),
                    limit,
                )
                instrumentation.errors_limited(sender)
                signals.stored_errors_limited.send_robust(
                    sender, principal=principal, limit=limit, view=view_name(sender)
                )
            return False
    if len(result.body) > conf.MAX_RESPONSE_BYTES:
        raise ImproperlyConfigured(
            f"An idempotent response of {len(result.body)} bytes exceeds "
            f"IDEMPOTENCY_MAX_RESPONSE_BYTES ({conf.MAX_RESPONSE_BYTES})."
        )
    return True
