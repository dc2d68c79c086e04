"""``OutboxTask``'s first import path, which projects' task modules name; it lives in
``messaging/outbox/celery.py``."""

from __future__ import annotations

from django_idempotency.messaging.outbox.celery import OutboxTask

__all__ = ["OutboxTask"]
