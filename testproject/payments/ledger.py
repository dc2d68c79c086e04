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
from testproject.payments.models import Capture, LedgerEntry


def post_ledger_entry(
    message_id: str,
    charge_id: int,
    amount: int,
    currency: str,
    *,
    capture: str = "",
    delay_ms: int = 0,
    crash_once: str = "",
    crash_after_commit_once: str = "",
) -> dict[str, Any]:
    """Write the charge's ledger row for message ``message_id``; what the consumer stores as
    its result (a redelivery is answered with it).

    ``capture``, the processor's capture id, names the charge when given: every run of the
    charge's request gets the same one (its processor key is derived from the request's),
    while the charge's id is new on each run. After an asynchronous failover lost a run's
    commit, its message may still arrive, and the new primary's sequence may have given that
    run's charge id to another charge: by its id the posting would go to that other charge.
    No capture yet (the run again has not committed, or never will): the posting fails, stores
    nothing, and the run again publishes it anew under the same message id."""
    if capture:
        charge_id = Capture.objects.values_list("charge_id", flat=True).get(capture_id=capture)
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
