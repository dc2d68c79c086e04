"""``manage.py idempotency_erase``: a principal's records become tombstones (data you keep)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router

from django_idempotency.admin.records import principals_of_username, user_principals
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage.erasure import BATCH, erase


class Command(BaseCommand):
    help = (
        "Erase a principal's idempotency records, of requests and of exactly-once consumers: "
        "their bodies, headers and paths go, a tombstone stays until they would have expired, "
        "and a retry of an erased key gets 410 key-expired. Safe to run again."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument(
            "--principal", action="append", help="a principal as stored (user:7, tenant:acme)"
        )
        who.add_argument("--user", help="a user's username or primary key: their principals")
        parser.add_argument("--database", help="the records' database (default: the router's)")
        parser.add_argument("--batch", type=int, default=BATCH, help=f"default: {BATCH}")

    def handle(self, *args: Any, **options: Any) -> None:
        principals = options["principal"] or self._user(options["user"])
        using = options["database"] or router.db_for_write(IdempotencyRecord)
        if options["batch"] < 1:
            raise CommandError("--batch must be 1 or more.")
        for principal in principals:
            erased = erase(using, principal, batch=options["batch"])
            self.stdout.write(f"{principal}: {erased} records erased")

    def _user(self, value: str) -> list[str]:
        principals = principals_of_username(value)
        if principals:
            return principals
        User = get_user_model()
        try:
            pk = User._meta.pk.to_python(value)
        except ValidationError:
            pk = None
        if pk is None or not User._default_manager.filter(pk=pk).exists():
            raise CommandError(f"No user has the username or primary key {value!r}.")
        return user_principals(pk)
