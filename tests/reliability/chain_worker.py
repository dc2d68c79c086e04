"""The Celery app the chain profile's workers run (``celery -A tests.reliability.chain_worker``):
the test project's own, plus one line per delivery in ``$RELIABILITY_DELIVERIES``.

Each publish of a message gets a new delivery tag from kombu, and Redis gives a message back
(visibility timeout, a worker lost, a rejected delivery) with the same tag, flagged
redelivered: so the lines count publishes per outbox row and the broker's redeliveries.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery.signals import task_received

from testproject.celery import app

__all__ = ["DELIVERIES", "app"]

DELIVERIES = "RELIABILITY_DELIVERIES"


@task_received.connect
def record_delivery(request: Any = None, **kwargs: Any) -> None:
    folder = os.environ.get(DELIVERIES)
    if not folder or request is None:
        return
    line = json.dumps(
        {
            "id": request.id,
            "tag": request.message.delivery_tag,
            "redelivered": bool(request.delivery_info.get("redelivered")),
            "at": time.time(),
        }
    )
    # A file per process and a write per line, flushed at once: a kill -9 loses at most the
    # delivery it was recording, which the broker then delivers again.
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as out:
        out.write(line + "\n")
