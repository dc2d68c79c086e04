"""The NATS consumer's first import path, which projects' handlers name; it lives in
``messaging/consumers/nats.py``."""

from __future__ import annotations

from django_idempotency.messaging.consumers.nats import NatsConsumer, StreamMessage

__all__ = ["NatsConsumer", "StreamMessage"]
