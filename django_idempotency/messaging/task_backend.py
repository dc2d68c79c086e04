"""``OutboxBackend``'s first import path, which projects' ``TASKS`` settings name; it lives in
``messaging/outbox/tasks.py``."""

from __future__ import annotations

from django_idempotency.messaging.outbox.tasks import OutboxBackend

__all__ = ["OutboxBackend"]
