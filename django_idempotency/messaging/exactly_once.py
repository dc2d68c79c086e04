"""The exactly-once core's first import path, which custom consumers name
(``docs/side-effects.md``); it lives in ``messaging/consumers/exactly_once.py``."""

from __future__ import annotations

from django_idempotency.messaging.consumers.exactly_once import (
    Delivery,
    arguments_digest,
    consume,
    principal,
)

__all__ = ["Delivery", "arguments_digest", "consume", "principal"]
