"""``manage.py idempotency_consume_nats`` as the chain profile runs it (``python -m
tests.reliability.chain_nats <the command's options>``): one line per delivery it takes
(``chain_deliveries.py``), before the exactly-once consumer handles it. A copy's tag is its
stream sequence, so a second publish of a row the stream kept (past its duplicate window)
counts as another copy, and JetStream's redeliveries of a copy are flagged."""

from __future__ import annotations

import sys
from typing import Any

from tests.reliability.chain_deliveries import record


def main(argv: list[str]) -> None:
    import django

    django.setup()
    from django.core.management import call_command

    from django_idempotency.messaging.consumers.nats import NatsConsumer, as_stream_message

    handle = NatsConsumer.handle

    def recorded(self: NatsConsumer, message: Any) -> None:
        delivered = as_stream_message(message)
        record(delivered.id, f"{delivered.stream}:{delivered.sequence}", delivered.delivered > 1)
        handle(self, message)

    NatsConsumer.handle = recorded  # type: ignore[method-assign]
    call_command("idempotency_consume_nats", *argv)


if __name__ == "__main__":
    main(sys.argv[1:])
