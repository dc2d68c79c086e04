"""``manage.py idempotency_probe URL [URL ...]``: the deployment probe, through the front door."""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency.probe.drive import probe


class Command(BaseCommand):
    help = (
        "Check that this deployment keeps the promise: each URL is where an app server (or "
        "the load balancer) serves django_idempotency.probe.urls. Exits 1 on a failed line."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("urls", nargs="+", help="base URLs of the mounted probe")
        parser.add_argument(
            "--token",
            default=os.environ.get("IDEMPOTENCY_PROBE_TOKEN"),
            help="the servers' IDEMPOTENCY_PROBE_TOKEN (default: that environment variable)",
        )
        parser.add_argument("--duplicates", type=int, default=16, help="default: 16")
        parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
        parser.add_argument(
            "--endpoint",
            action="append",
            default=[],
            help="a protected view of the project's (a path), asked with the probe header: "
            "its checks run, the view does not (repeatable)",
        )
        parser.add_argument(
            "--header",
            action="append",
            default=[],
            help='a header of a real client for --endpoint, "Name: value" (repeatable)',
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["token"]:
            raise CommandError("Pass --token or set IDEMPOTENCY_PROBE_TOKEN.")
        if options["duplicates"] < 2:
            raise CommandError("--duplicates must be 2 or more.")
        credentials = {}
        for line in options["header"]:
            name, colon, value = line.partition(":")
            if not colon or not name.strip():
                raise CommandError(f'--header takes "Name: value", not {line!r}.')
            credentials[name.strip()] = value.strip()
        report = probe(
            options["urls"],
            options["token"],
            duplicates=options["duplicates"],
            timeout=options["timeout"],
            endpoints=options["endpoint"],
            credentials=credentials,
        )
        self.stdout.write(report.as_json() if options["json"] else report.text())
        if not report.passed:
            raise SystemExit(1)
