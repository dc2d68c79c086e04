"""``manage.py idempotency_cdc``: the event table's publication for change data capture
(make it, or print its SQL for a DBA) and whether the database is ready for a connector."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections, router

from django_idempotency.conf import conf
from django_idempotency.db import sqlstate
from django_idempotency.messaging.cdc import publication
from django_idempotency.models import OutboxEvent

# PostgreSQL's insufficient_privilege.
INSUFFICIENT_PRIVILEGE = "42501"


class Command(BaseCommand):
    help = (
        "Change data capture from the event table: `publication` creates the publication "
        "Debezium reads (FOR TABLE the event table, publish_via_partition_root) or, with "
        "--sql, prints it for someone with the rights; `status` says whether the database is "
        "ready and how far behind each logical replication slot is (exit 1 if not ready)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            help="the event table's database (default: where the router writes OutboxEvent)",
        )
        parser.add_argument(
            "--publication",
            help="the publication's name (default: IDEMPOTENCY_CDC_PUBLICATION)",
        )
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser(
            "publication", help="create the publication, or bring it to shape"
        )
        create.add_argument(
            "--sql", action="store_true", help="print the SQL instead of running it"
        )
        actions.add_parser("status", help="publication, wal_level and slots; exit 1 if not ready")

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"] or router.db_for_write(OutboxEvent)
        name = options["publication"] or conf.CDC_PUBLICATION
        if not name:
            raise CommandError(
                "Which publication? Set IDEMPOTENCY_CDC_PUBLICATION (the name your connector's "
                "publication.name reads, e.g. 'django_idempotency_events') or pass "
                "--publication."
            )
        if connections[using].vendor != "postgresql":
            raise CommandError(
                f"Database {using!r} is {connections[using].vendor}: change data capture "
                "through a publication needs PostgreSQL."
            )
        try:
            found = publication.state(using, name)
        except DatabaseError as exc:
            raise CommandError(f"Cannot read the publication on {using!r}: {exc}") from exc
        if options["action"] == "status":
            self._status(using, found)
        elif options["sql"]:
            needed = publication.statements(using, found)
            self.stdout.write("\n".join(f"{s};" for s in needed) or "-- nothing to do")
        else:
            self._create(using, name)

    def _create(self, using: str, name: str) -> None:
        try:
            done = publication.apply(using, name)
        except DatabaseError as exc:
            if sqlstate(exc) != INSUFFICIENT_PRIVILEGE:
                raise CommandError(f"Could not create the publication: {exc}") from exc
            raise CommandError(
                f"This role may not create the publication: {exc}. CREATE PUBLICATION "
                "needs ownership of the event table and CREATE on the database (FOR ALL "
                "TABLES needs a superuser). Run `manage.py idempotency_cdc publication --sql` "
                "and have the table's owner or your DBA run what it prints."
            ) from exc
        if not done:
            self.stdout.write(f"Publication {name!r} is ready on {using!r}; nothing to do.")
        for statement in done:
            self.stdout.write(f"{statement};")

    def _status(self, using: str, found: publication.State) -> None:
        self.stdout.write(f"database {using!r}: wal_level = {found.wal_level}")
        shape = "; ".join(found.problems()) or (
            f"publication {found.publication!r}: inserts of the event table, through its root"
        )
        self.stdout.write(shape)
        if not found.slots:
            self.stdout.write("no logical replication slot on this database")
        for slot in found.slots:
            lag = "unknown" if slot.lag_bytes is None else f"{slot.lag_bytes} bytes"
            self.stdout.write(
                f"slot {slot.name} ({slot.plugin}, {'active' if slot.active else 'inactive'}): "
                f"confirmed up to {slot.confirmed_flush_lsn}, {lag} behind"
            )
        if found.problems() or not found.decodes:
            raise CommandError("Not ready for change data capture (above).", returncode=1)
