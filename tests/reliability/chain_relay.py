"""``manage.py idempotency_relay`` as the chain profile runs it (``python -m
tests.reliability.chain_relay``): ``SIGUSR1`` arms it to ``kill -9`` itself after its next
publish and before it marks the rows published, the one moment at which a relay's death makes
the rows go out twice. Killed at any other moment it publishes nothing twice."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

DIED = "chain relay: killed between publish and mark"


def main() -> None:
    import django

    django.setup()
    from django.core.management import call_command

    from django_idempotency.messaging.relay.loop import Relay

    armed = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: armed.set())
    mark = Relay.mark

    def mark_or_die(self: Relay, batch: Any, messages: Any) -> int:
        if messages and armed.is_set():
            print(DIED, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return mark(self, batch, messages)

    Relay.mark = mark_or_die  # type: ignore[method-assign]
    call_command("idempotency_relay")


if __name__ == "__main__":
    main()
