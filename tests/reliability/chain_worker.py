"""The Celery app the chain profile's workers run (``celery -A tests.reliability.chain_worker``):
the test project's own, plus one line per delivery (``chain_deliveries.py``).

Each publish of a message gets a new delivery tag from kombu, and Redis gives a message back
(visibility timeout, a worker lost, a rejected delivery) with the same tag, flagged
redelivered: so the lines count publishes per outbox row and the broker's redeliveries.
"""

from __future__ import annotations

from typing import Any

from celery.signals import task_received

from testproject.celery import app
from tests.reliability.chain_deliveries import record

__all__ = ["app"]


@task_received.connect
def record_delivery(request: Any = None, **kwargs: Any) -> None:
    if request is None:
        return
    record(
        request.id,
        request.message.delivery_tag,
        bool(request.delivery_info.get("redelivered")),
    )
