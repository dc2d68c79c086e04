"""Claims held from another connection, and a record store that cannot be reached."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.utils import load_backend

from django_idempotency import storage
from django_idempotency.models import IdempotencyRecord


def claim(
    scope: str,
    key: str,
    *,
    wait: timedelta = timedelta(0),
    now: Any = None,
    ttl: timedelta = timedelta(hours=24),
    gone: timedelta = timedelta(0),
    using: str = DEFAULT_DB_ALIAS,
) -> storage.Claim:
    """``storage.claim`` with the defaults the engine uses; call inside ``atomic``."""
    return storage.claim(
        using, scope=scope, key=key, method="POST", path="/drf/", fingerprint={"body": "x"},
        ttl=ttl, window=timedelta(hours=24) + gone, gone=gone, wait=wait, now=now,
    )  # fmt: skip


@contextlib.contextmanager
def held_claim(scope: str, key: str) -> Iterator[None]:
    """Another connection claims (scope, key) and holds it, as an in-flight first request
    does, until the block ends; then it rolls back."""
    holding, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                outcome = claim(scope, key).outcome
                if outcome != storage.WON:
                    raise AssertionError(f"the holder could not claim the key: {outcome}")
                holding.set()
                done.wait(60)
                transaction.set_rollback(True)
        except BaseException as exc:
            errors.append(exc)
            holding.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    holding.wait(30)
    if errors:
        raise errors[0]
    try:
        yield
    finally:
        done.set()
        thread.join(30)


class RecordsRouter:
    """Sends the records (and nothing else) to another database alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model is IdempotencyRecord else None

    db_for_read = db_for_write


@contextlib.contextmanager
def unreachable_store(settings: Any, alias: str = "unreachable") -> Iterator[str]:
    """Route the records to a PostgreSQL alias whose port refuses connections."""
    # A bound socket that never listens: connecting to it is refused at once.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        settings_dict = {
            **connections.settings[DEFAULT_DB_ALIAS],
            "HOST": "127.0.0.1",
            "PORT": str(closed.getsockname()[1]),
            "CONN_MAX_AGE": 0,
            "CONN_HEALTH_CHECKS": False,
        }
        # Created here rather than added to DATABASES: Django's test case only allows
        # connections to aliases it was told about, or ones made on the fly like this.
        wrapper = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, alias)
        connections[alias] = wrapper
        settings.DATABASE_ROUTERS = [RecordsRouter(alias)]
        try:
            yield alias
        finally:
            wrapper.close()
            del connections[alias]
