"""``deliver``'s first import path: every job the Tasks destination queues names it
(``consumers.tasks.QUEUED_AS``), so it resolves here to the one task; it lives in
``messaging/consumers/tasks.py``."""

from __future__ import annotations

from django_idempotency.messaging.consumers.tasks import DELIVER, deliver

__all__ = ["DELIVER", "deliver"]
