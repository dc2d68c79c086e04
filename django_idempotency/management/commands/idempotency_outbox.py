"""``manage.py idempotency_outbox``: the outbox's state and its relays' heartbeats, count
the dead letters, requeue them."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router
from django.utils import timezone

from django_idempotency.messaging.outbox import leases
from django_idempotency.messaging.relay import heartbeats
from django_idempotency.models import OutboxMessage

# Counted up to this many.
COUNT_LIMIT = 1_000_000


class Command(BaseCommand):
    help = (
        "`status` shows the backlog, the dead letters and the relays' heartbeats, and fails "
        "when messages wait and no relay has beaten lately (a health check). The dead "
        "letters (messages that failed to publish IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS times): "
        "`dead` counts them, `requeue` gives them their tries back, to be published again "
        "under the same ids."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            help="the outbox's database (default: where the router writes OutboxMessage)",
        )
        actions = parser.add_subparsers(dest="action", required=True)
        actions.add_parser(
            "status",
            help="backlog, dead letters and relays; exits 1 when messages wait and no relay "
            "has beaten lately",
        )
        actions.add_parser("dead", help="count the dead letters")
        requeue = actions.add_parser("requeue", help="publish dead letters again")
        chosen = requeue.add_mutually_exclusive_group(required=True)
        chosen.add_argument("--id", action="append", dest="ids", help="a message id (repeatable)")
        chosen.add_argument("--all-dead", action="store_true", help="every dead letter")

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"] or router.db_for_write(OutboxMessage)
        if options["action"] == "status":
            self.status(using)
            return
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

    def status(self, using: str) -> None:
        now = timezone.now()
        backlog = leases.backlog(using, COUNT_LIMIT)
        oldest = leases.oldest_pending(using)
        age = "" if oldest is None else f", the oldest {(now - oldest).total_seconds():.0f} s old"
        self.stdout.write(f"Backlog: {backlog} messages waiting to be published{age}.")
        self.stdout.write(f"Dead letters: {leases.dead_letters(using, COUNT_LIMIT)}.")
        relays = heartbeats.relays(using)
        if not relays:
            self.stdout.write("Relays: none has a heartbeat.")
        for relay in relays:
            beat = heartbeats.age(relay, now)
            state = "" if heartbeats.alive(relay, now) else " (stale: dead or hung?)"
            error = f", last error: {relay.last_error}" if relay.last_error else ""
            self.stdout.write(
                f"Relay {relay.owner} on {relay.host}, pid {relay.pid}: last beat {beat:.0f} s "
                f"ago{state}, started {relay.started_at.isoformat(timespec='seconds')}, "
                f"{relay.published} published, {relay.failed} failed publishes{error}."
            )
        if backlog and not any(heartbeats.alive(relay, now) for relay in relays):
            raise CommandError(
                f"{backlog} messages wait and no relay has beaten in the last "
                f"{heartbeats.STALE_AFTER.total_seconds():.0f} s: start one "
                "(python manage.py idempotency_relay), or see why it stopped."
            )
