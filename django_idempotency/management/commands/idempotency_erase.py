"""``manage.py idempotency_erase``: a principal's records become tombstones (data you keep)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router

from django_idempotency.admin.records import principals_of_username, user_principals
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage.erasure import BATCH, WAIT, ErasureIncomplete, erase


class Command(BaseCommand):
    help = (
        "Erase a principal's idempotency records, of requests and of exactly-once consumers: "
        "their bodies, headers and paths go, a tombstone stays until they would have expired, "
        "and a retry of an erased key gets 410 key-expired. Then waits for the requests in "
        "flight when it began and erases what they commit; exits non-zero, saying so, if "
        "some still run after --wait seconds. Safe to run again."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument(
            "--principal", action="append", help="a principal as stored (user:7, tenant:acme)"
        )
        who.add_argument("--user", help="a user's username or primary key: their principals")
        parser.add_argument("--database", help="the records' database (default: the router's)")
        parser.add_argument("--batch", type=int, default=BATCH, help=f"default: {BATCH}")
        parser.add_argument(
            "--wait",
            type=float,
            default=WAIT.total_seconds(),
            help="seconds to wait for the requests in flight when the erasure began "
            f"(default: {WAIT.total_seconds():g})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        principals = options["principal"] or self._user(options["user"])
        using = options["database"] or router.db_for_write(IdempotencyRecord)
        if options["batch"] < 1:
            raise CommandError("--batch must be 1 or more.")
        if not options["wait"] >= 0:
            raise CommandError("--wait must be 0 or more seconds.")
        wait = timedelta(seconds=options["wait"])
        incomplete: list[str] = []
        for principal in principals:
            try:
                erased = erase(using, principal, batch=options["batch"], wait=wait)
            except ErasureIncomplete as exc:
                self.stdout.write(f"{principal}: {exc.erased} records erased, incomplete")
                self.stderr.write(f"{principal}: {exc}")
                incomplete.append(principal)
            else:
                self.stdout.write(f"{principal}: {erased} records erased")
        if incomplete:
            raise CommandError(
                f"The erasure of {len(incomplete)} principal(s) is incomplete: requests in "
                "flight when it began may have committed records after it. Run it again."
            )

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
