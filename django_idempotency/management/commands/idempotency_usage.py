"""``manage.py idempotency_usage``: who fills the records table, per principal, for a day."""

from __future__ import annotations

from datetime import date
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router

from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions.catalog import utc_today
from django_idempotency.storage.usage import usage


class Command(BaseCommand):
    help = (
        "Show the principals whose records of one day (UTC) take the most space: stored "
        "bytes (bodies, headers, fingerprints) and records. Reads that day's partition only."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--day", help="YYYY-MM-DD (default: today, UTC)")
        parser.add_argument("--top", type=int, default=20, help="default: 20")
        parser.add_argument("--database", help="the records' database (default: the router's)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            day = date.fromisoformat(options["day"]) if options["day"] else utc_today()
        except ValueError as exc:
            raise CommandError(f"--day must be YYYY-MM-DD, not {options['day']!r}.") from exc
        using = options["database"] or router.db_for_write(IdempotencyRecord)
        found = usage(using, day, top=options["top"])
        labels = conf.PRINCIPAL_DISPLAY([row.principal for row in found])
        self.stdout.write(f"{'stored bytes':>14} {'records':>9}  principal ({day.isoformat()})")
        for row in found:
            label = labels.get(row.principal)
            name = row.principal if label is None else f"{label} ({row.principal})"
            self.stdout.write(f"{row.stored_bytes:>14,} {row.records:>9,}  {name}")
