"""Which results a unit stores: not a 5xx, and a 4xx only within its size and its
principal's per-minute budget in this process."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.engine import instrumentation
from django_idempotency.engine.work import Result, view_name

logger = logging.getLogger("django_idempotency")


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


def keeps(result: Result, principal: str, sender: Any) -> bool:
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
        seen = 0 if limit is None else error_budget.take(principal)
        if limit is not None and seen >= limit:
            # Likewise, a client cannot make the store keep a record per 4xx at any
            # rate: answered, not stored, and the key stays free. Logged, counted and
            # signalled once a minute per principal.
            if seen == limit:
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
