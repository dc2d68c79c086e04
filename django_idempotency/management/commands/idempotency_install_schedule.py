from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_idempotency.beat import SCHEDULE_NAME, BeatNotInstalled, install_schedule


class Command(BaseCommand):
    help = (
        "Create the django-celery-beat periodic task that runs partition maintenance, "
        "unless it exists; --force resets it to the defaults."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--force", action="store_true", help="Reset an existing row to the defaults."
        )
        parser.add_argument("--database", default=None, help="Database alias.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            row, outcome = install_schedule(using=options["database"], force=options["force"])
        except BeatNotInstalled as exc:
            raise CommandError(str(exc)) from exc
        if outcome == "kept":
            self.stdout.write(
                f"Periodic task {SCHEDULE_NAME!r} exists ({row.crontab or 'edited'}); "
                "left as it is. --force resets it."
            )
        else:
            self.stdout.write(f"Periodic task {SCHEDULE_NAME!r} {outcome}: {row.crontab}")
