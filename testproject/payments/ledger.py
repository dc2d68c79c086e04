"""The ledger posting, the one effect of a charge's ledger message whichever way it arrives:
the Celery task ``payments.post_ledger_entry`` (``tasks.py``), the same message read from NATS
JetStream (``handlers.py``), or a task of Django's Tasks framework (``ledger_tasks.py``). Each
runs it inside its exactly-once consumer, so its row and the consumer's record commit together.

The keyword arguments after ``*`` are fault switches for the demo and the tests, honoured
when ``PAYMENTS_FAULTS_ENABLED``: a delay, a SIGKILL of the consumer's process mid-posting
(row written, not committed) or right after the commit, before the transport hears of it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from django.conf import settings
from django.db import transaction

from testproject.payments.faults import first_sighting
from testproject.payments.models import LedgerEntry


def post_ledger_entry(
    message_id: str,
    charge_id: int,
    amount: int,
    currency: str,
    *,
    delay_ms: int = 0,
    crash_once: str = "",
    crash_after_commit_once: str = "",
) -> dict[str, Any]:
    """Write the charge's ledger row for message ``message_id``; what the consumer stores as
    its result (a redelivery is answered with it)."""
    entry = LedgerEntry.objects.create(
        charge_id=charge_id, amount=amount, currency=currency, message_id=message_id
    )
    if getattr(settings, "PAYMENTS_FAULTS_ENABLED", False):
        if delay_ms:
            time.sleep(delay_ms / 1000)
        if crash_once and first_sighting(f"ledger_crash_once:{crash_once}"):
            # The process dies mid-posting, its row written but not committed.
            os.kill(os.getpid(), signal.SIGKILL)
        if crash_after_commit_once:
            # After the consumer's commit, before the broker hears of it: the hardest moment
            # to die, as the message comes again though its effect already happened.
            transaction.on_commit(lambda: _crash_after_commit(crash_after_commit_once))
    return {"entry": entry.pk, "charge": charge_id}


def _crash_after_commit(tag: str) -> None:
    if first_sighting(f"ledger_crash_after_commit_once:{tag}"):
        os.kill(os.getpid(), signal.SIGKILL)
