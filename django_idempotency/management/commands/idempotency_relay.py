"""``manage.py idempotency_relay``: publish the outbox to the broker, until stopped."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_idempotency.messaging.relay import PublishFailed, Relay


class Command(BaseCommand):
    help = (
        "Publish committed outbox messages to the Celery broker: woken by each commit "
        "(LISTEN/NOTIFY), with a slow poll underneath. Run one or more, each a process."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="publish what is there, then exit")
        parser.add_argument(
            "--batch-size",
            type=int,
            help="rows claimed per pass (default: IDEMPOTENCY_OUTBOX_BATCH_SIZE)",
        )
        parser.add_argument(
            "--database",
            help="the outbox's database (default: where the router writes OutboxMessage)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        relay = Relay(using=options["database"], batch_size=options["batch_size"])

        def stop(signum: int, frame: FrameType | None) -> None:
            # Finish the message in hand, mark what went out, give the rest back.
            relay.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            published = relay.run(once=options["once"])
        except PublishFailed as exc:
            raise SystemExit(f"Publishing failed: {exc}") from exc
        if options["once"] and options["verbosity"] > 0:
            self.stdout.write(f"Published {published} messages.")
