"""The payments API's Celery tasks: ``post_ledger_entry``, exactly once per message.

A charge puts the call in the outbox (``enqueue_task``) in its own transaction; the relay
publishes it with the outbox message id as task id; a redelivery of that id (a worker killed
after its commit, a relay that published twice, Redis' visibility timeout) posts nothing.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from django_idempotency.messaging.consumers import ExactlyOnceTask
from testproject.payments import ledger

POST_LEDGER_ENTRY = "payments.post_ledger_entry"


@shared_task(base=ExactlyOnceTask, bind=True, name=POST_LEDGER_ENTRY)
def post_ledger_entry(
    self: ExactlyOnceTask,
    charge_id: int,
    amount: int,
    currency: str,
    *,
    capture: str = "",
    delay_ms: int = 0,
    crash_once: str = "",
    crash_after_commit_once: str = "",
) -> dict[str, Any]:
    """Post a charge to the ledger (``ledger.post_ledger_entry``: ``capture`` names the
    charge; the keyword arguments after it are its fault switches)."""
    return ledger.post_ledger_entry(
        str(self.request.id), charge_id, amount, currency, capture=capture, delay_ms=delay_ms,
        crash_once=crash_once, crash_after_commit_once=crash_after_commit_once,
    )  # fmt: skip
