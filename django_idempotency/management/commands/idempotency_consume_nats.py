"""``manage.py idempotency_consume_nats``: run a handler once per message of a NATS JetStream
durable consumer, until stopped (``messaging/consumers/nats.py``)."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.module_loading import import_string

from django_idempotency.management.commands.idempotency_relay import show_logs


class Command(BaseCommand):
    help = (
        "Consume a NATS JetStream stream through a durable pull consumer, running --handler "
        "once per message id (Nats-Msg-Id): its writes and the record commit together, then "
        "the message is acknowledged."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--stream", required=True, help="the stream to consume")
        parser.add_argument("--durable", required=True, help="the durable consumer's name")
        parser.add_argument(
            "--handler",
            required=True,
            help="dotted path of a callable taking one StreamMessage",
        )
        parser.add_argument(
            "--subject", default="", help="only this subject (filter) of the stream"
        )
        parser.add_argument(
            "--consumer",
            help="the name message ids are scoped by (default: the durable's name)",
        )
        parser.add_argument(
            "--servers",
            nargs="+",
            default=["nats://127.0.0.1:4222"],
            help="NATS server URLs (default: nats://127.0.0.1:4222)",
        )
        parser.add_argument("--batch", type=int, default=10, help="messages per fetch")
        parser.add_argument(
            "--ack-wait",
            type=float,
            default=30.0,
            help="seconds before JetStream delivers an unacknowledged message again (default 30)",
        )
        parser.add_argument(
            "--max-deliver",
            type=int,
            default=-1,
            help="deliveries of a message at most, then JetStream stops (default: no limit)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Imported here: nats-py is an extra.
        try:
            from nats.js.errors import APIError

            from django_idempotency.messaging.consumers.nats import NatsConsumer
        except ImportError as exc:
            raise CommandError(
                f"{exc}: install the nats extra (django-idempotency[nats])."
            ) from exc
        try:
            handler = import_string(options["handler"])
        except ImportError as exc:
            raise CommandError(
                f"--handler {options['handler']!r} cannot be imported: {exc}"
            ) from exc
        if not callable(handler):
            raise CommandError(f"--handler {options['handler']!r} is not callable.")
        if options["verbosity"] > 0:
            show_logs()
        try:
            consumer = NatsConsumer(
                handler,
                stream=options["stream"],
                durable=options["durable"],
                subject=options["subject"],
                consumer=options["consumer"],
                servers=options["servers"],
                batch=options["batch"],
                ack_wait=options["ack_wait"],
                max_deliver=options["max_deliver"],
            )
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc

        def stop(signum: int, frame: FrameType | None) -> None:
            # The message in hand is finished and acknowledged; the rest go back.
            consumer.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            consumer.run()
        except APIError as exc:  # no such stream, a durable of another configuration
            raise CommandError(f"JetStream refused the consumer: {exc}") from exc
