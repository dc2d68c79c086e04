from __future__ import annotations

import time
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_idempotency.conf import conf
from django_idempotency.storage import rekeying, sealing


class Command(BaseCommand):
    help = (
        "Seal every stored response under the first of IDEMPOTENCY_ENCRYPTION_KEYS (plain "
        "ones and those under other keys), in small batches; safe to stop and run again."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--batch-size", type=int, default=200, help="Records a batch.")
        parser.add_argument(
            "--pause", type=float, default=0.0, help="Seconds to sleep between batches."
        )
        parser.add_argument(
            "--after", type=int, default=0, help="Start after this record id (to resume)."
        )
        parser.add_argument("--database", default=None, help="Database alias.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            ring = sealing.keyring(conf.ENCRYPTION_KEYS)
        except sealing.MalformedKeys as exc:
            raise CommandError(str(exc)) from exc
        if ring is None:
            raise CommandError(
                "IDEMPOTENCY_ENCRYPTION_KEYS is empty: there is no key to seal under."
            )
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1.")
        after, batches, plain, other = options["after"], 0, 0, 0
        unreadable: list[tuple[int, str]] = []
        while True:
            done = rekeying.reseal_batch(
                ring,
                using=options["database"],
                after=after,
                size=options["batch_size"],
                min_bytes=conf.COMPRESS_MIN_BYTES,
                codec=conf.BODY_COMPRESSION,
            )
            if done.last_id is None:
                break
            batches += 1
            after = done.last_id
            plain += done.from_plain
            other += done.from_other_keys
            unreadable += done.unreadable
            if options["verbosity"] > 1:
                self.stdout.write(f"Batch {batches}: up to record {after}.")
            if options["pause"]:
                time.sleep(options["pause"])
        self.stdout.write(
            f"Re-encrypted {plain + other} record(s) under key {ring.sealing.id} "
            f"({plain} plain, {other} under other keys) in {batches} batch(es); "
            f"last record id {after}."
        )
        for record_id, why in unreadable[:20]:
            self.stderr.write(f"Record {record_id} left as it is: {why}.")
        if unreadable:
            raise CommandError(
                f"{len(unreadable)} record(s) could not be opened with the listed keys and were "
                "left as they are."
            )
