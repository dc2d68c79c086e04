"""A relay run in a thread for the duration of a block."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from django.db import connections

from django_idempotency.messaging.relay.loop import Relay


@contextlib.contextmanager
def running(relay: Relay, *, once: bool = False) -> Iterator[threading.Thread]:
    """Run ``relay`` in a thread until the block ends, then stop it."""

    def target() -> None:
        try:
            relay.run(once=once)
        finally:
            connections[relay.using].close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        relay.stop()
        thread.join(timeout=30)
