"""``manage.py idempotency_outbox``: count the outbox's dead letters, requeue them."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router

from django_idempotency.messaging import leases
from django_idempotency.models import OutboxMessage

# Counted up to this many.
COUNT_LIMIT = 1_000_000


class Command(BaseCommand):
    help = (
        "The outbox's dead letters (messages that failed to publish "
        "IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS times): `dead` counts them, `requeue` gives them "
        "their tries back, to be published again under the same ids."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            help="the outbox's database (default: where the router writes OutboxMessage)",
        )
        actions = parser.add_subparsers(dest="action", required=True)
        actions.add_parser("dead", help="count the dead letters")
        requeue = actions.add_parser("requeue", help="publish dead letters again")
        chosen = requeue.add_mutually_exclusive_group(required=True)
        chosen.add_argument("--id", action="append", dest="ids", help="a message id (repeatable)")
        chosen.add_argument("--all-dead", action="store_true", help="every dead letter")

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"] or router.db_for_write(OutboxMessage)
        if options["action"] == "dead":
            self.stdout.write(f"{leases.dead_letters(using, COUNT_LIMIT)} dead letters.")
            return
        ids = options.get("ids")
        for message_id in ids or ():
            try:
                uuid.UUID(message_id)
            except ValueError:
                raise CommandError(f"{message_id!r} is not a message id (a UUID).") from None
        count = leases.requeue(using, None if options["all_dead"] else ids)
        self.stdout.write(f"Requeued {count} dead letters.")
        if ids and count < len(set(ids)):
            raise CommandError(
                f"{len(set(ids)) - count} of the ids given are not dead letters "
                "(published, still being tried, or no such message)."
            )
