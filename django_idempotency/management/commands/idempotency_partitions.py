from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_idempotency.partitions.maintain import MaintenanceFailed, maintain


class Command(BaseCommand):
    help = (
        "Create upcoming partitions of django-idempotency's tables (records, and the messaging "
        "tables) and drop expired ones (on databases without partitions: delete expired "
        "rows). Run it hourly."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Print the plan and change nothing."
        )
        parser.add_argument("--no-drop", action="store_true", help="Create partitions; drop none.")
        parser.add_argument(
            "--database", default=None, help="Database alias (default: where records go)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            report = maintain(
                options["database"],
                dry_run=options["dry_run"],
                drop=False if options["no_drop"] else None,
            )
        except MaintenanceFailed as exc:
            if exc.report is not None:
                self.stdout.write("\n".join(exc.report.lines()))
            raise CommandError(f"Partition maintenance failed: {exc}") from exc
        self.stdout.write("\n".join(report.lines()))
