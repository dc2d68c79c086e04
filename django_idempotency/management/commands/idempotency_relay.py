"""``manage.py idempotency_relay``: publish the outbox to its destinations, until stopped."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency.messaging.relay.loop import PublishFailed, Relay


class Command(BaseCommand):
    help = (
        "Publish committed outbox messages to the destinations of "
        "IDEMPOTENCY_OUTBOX_DESTINATIONS (a Celery broker, NATS JetStream, a backend of "
        "Django's Tasks framework): woken by each commit (LISTEN/NOTIFY), with a slow poll "
        "underneath. Run one or more, each a process."
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
        if options["verbosity"] > 0:
            show_logs()
        try:
            relay = Relay(using=options["database"], batch_size=options["batch_size"])
        except ImproperlyConfigured as exc:
            # Celery's default app: refuse to start rather than publish where nobody reads.
            raise CommandError(str(exc)) from exc

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


def show_logs() -> None:
    """Send the app's log lines to stderr where nothing else would show them.

    Django's default logging (no ``LOGGING`` setting) gives this app's loggers no handler:
    their INFO lines, such as the relay's start line naming its Celery app and broker, would
    reach nobody. A project whose logging takes them keeps it as it is.
    """
    package = logging.getLogger("django_idempotency")
    if package.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)
