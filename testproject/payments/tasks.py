"""The payments API's Celery tasks: ``post_ledger_entry``, exactly once per message.

A charge puts the call in the outbox (``enqueue_task``) in its own transaction; the relay
publishes it with the outbox message id as task id; a redelivery of that id (a worker killed
after its commit, a relay that published twice, Redis' visibility timeout) posts nothing.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery import shared_task
from celery.signals import task_postrun
from django.conf import settings

from django_idempotency.messaging.consumers import ExactlyOnceTask
from testproject.payments.faults import first_sighting
from testproject.payments.models import LedgerEntry

POST_LEDGER_ENTRY = "payments.post_ledger_entry"


@shared_task(base=ExactlyOnceTask, bind=True, name=POST_LEDGER_ENTRY)
def post_ledger_entry(
    self: ExactlyOnceTask,
    charge_id: int,
    amount: int,
    currency: str,
    *,
    delay_ms: int = 0,
    crash_once: str = "",
    crash_after_commit_once: str = "",
) -> dict[str, Any]:
    """Post a charge to the ledger. The keyword arguments after ``*`` are fault switches
    for the demo and the tests (honoured when ``PAYMENTS_FAULTS_ENABLED``)."""
    entry = LedgerEntry.objects.create(
        charge_id=charge_id, amount=amount, currency=currency, message_id=str(self.request.id)
    )
    if getattr(settings, "PAYMENTS_FAULTS_ENABLED", False):
        if delay_ms:
            time.sleep(delay_ms / 1000)
        if crash_once and first_sighting(f"ledger_crash_once:{crash_once}"):
            # The worker process dies mid-task, its row written but not committed.
            os.kill(os.getpid(), signal.SIGKILL)
    return {"entry": entry.pk, "charge": charge_id}


@task_postrun.connect
def _crash_after_commit(sender: Any = None, kwargs: Any = None, **extra: Any) -> None:
    # After the task's commit, before the worker acknowledges the message: the hardest
    # moment to die, as the broker redelivers a message whose effect already happened.
    tag = (kwargs or {}).get("crash_after_commit_once")
    if (
        getattr(sender, "name", None) == POST_LEDGER_ENTRY
        and tag
        and getattr(settings, "PAYMENTS_FAULTS_ENABLED", False)
        and first_sighting(f"ledger_crash_after_commit_once:{tag}")
    ):
        os.kill(os.getpid(), signal.SIGKILL)
