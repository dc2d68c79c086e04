"""Claims held from another connection, and a record store that cannot be reached."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.utils import load_backend

from django_idempotency.engine.hashing import lock_id
from django_idempotency.engine.waiting import waiters
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import records as storage


def claim(
    scope: str,
    key: str,
    *,
    wait: timedelta = timedelta(0),
    now: Any = None,
    gone: timedelta = timedelta(0),
    using: str = DEFAULT_DB_ALIAS,
) -> storage.Claimed:
    """``storage.claim`` with the defaults the engine uses; call inside ``atomic``."""
    return storage.claim(
        using, lock=lock_id(using, scope, key), principal=scope, key=key,
        window=timedelta(hours=24) + gone, gone=gone, wait=wait, now=now,
    )  # fmt: skip


def body_of(size: int) -> bytes:
    """Bytes of every value, so that any text escaping of the body would show."""
    return (bytes(range(256)) * (size // 256 + 1))[:size]


def store_body(scope: str, key: str, body: bytes, *, commit: bool) -> None:
    """Claim (scope, key) and store ``body`` for it, in the caller's transaction."""
    claimed = claim(scope, key)
    assert claimed.created_at is not None
    storage.store(
        DEFAULT_DB_ALIAS,
        storage.Finished(
            principal=scope, key=key, method="POST", path="/drf/", fingerprint={"body": "x"},
            created_at=claimed.created_at, expires_at=claimed.created_at + timedelta(hours=24),
            code=201, headers=[["Content-Type", "application/octet-stream"]], body=body,
            body_encoding="", generation=claimed.generation,
        ),
        row_id=None,
        commit=commit,
    )  # fmt: skip


def store_first(scope: str, key: str, claimed: storage.Claimed, *, ttl: timedelta) -> None:
    """Store a finished record for a claim that won: 201 ``first``, as text."""
    assert claimed.created_at is not None
    finished = storage.Finished(
        principal=scope, key=key, method="POST", path="/drf/", fingerprint={"body": "x"},
        created_at=claimed.created_at, expires_at=claimed.created_at + ttl, code=201,
        headers=[["Content-Type", "text/plain"]], body=b"first", body_encoding="",
        generation=claimed.generation,
    )  # fmt: skip
    storage.store(DEFAULT_DB_ALIAS, finished, row_id=claimed.row_id, commit=False)


class ClaimThread(threading.Thread):
    """A claim on its own connection, in its own transaction, as another worker makes it.

    ``claimed`` is set once the claim returned (``outcome`` / ``error`` then tell how);
    the transaction stays open until ``finish`` is set, then the thread completes the
    record if it won and ``complete`` is true, or rolls back.
    """

    def __init__(
        self, scope: str, key: str, *, complete: bool = False, wait: timedelta = timedelta(0),
        now: Any = None,
    ) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.scope, self.key, self.complete, self.wait, self.now = scope, key, complete, wait, now
        self.claimed, self.finish = threading.Event(), threading.Event()
        self.outcome: storage.Outcome | None = None
        self.error: BaseException | None = None
        self.pid: int | None = None

    def run(self) -> None:
        try:
            with transaction.atomic():
                self.pid = connection_pid()
                claimed = claim(self.scope, self.key, wait=self.wait, now=self.now)
                self.outcome = claimed.outcome
                self.claimed.set()
                self.finish.wait(60)
                if self.complete and claimed.outcome is storage.Outcome.WON:
                    store_first(self.scope, self.key, claimed, ttl=timedelta(hours=24))
                else:
                    transaction.set_rollback(True)
        except BaseException as exc:
            self.error = exc
        finally:
            self.claimed.set()
            connections.close_all()

    def result(self, timeout: float = 60) -> storage.Outcome | None:
        self.finish.set()
        self.join(timeout)
        assert not self.is_alive(), "the claiming thread is stuck"
        return self.outcome


def connection_pid() -> int:
    with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    return int(pid)


def advisory_lock_waiters() -> int:
    """Connections to this database waiting for an advisory lock (a claim's wait)."""
    with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        (count,) = cursor.fetchone()
    return int(count)


def wait_for_lock_waiters(count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while advisory_lock_waiters() < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {count} claims are waiting after {timeout}s")
        time.sleep(0.02)


def wait_for_waiting_requests(count: int, timeout: float = 60) -> None:
    """Until ``count`` requests served by this process (a live server in a thread) wait
    for a holder, between their claims."""
    deadline = time.monotonic() + timeout
    while waiters.waiting < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {count} requests are waiting after {timeout}s")
        time.sleep(0.02)


@contextlib.contextmanager
def held_claim(scope: str, key: str) -> Iterator[ClaimThread]:
    """Another connection claims (scope, key) and holds it, as an in-flight first request
    does, until the block ends; then it rolls back."""
    holder = ClaimThread(scope, key)
    holder.start()
    holder.claimed.wait(30)
    if holder.error is not None or holder.outcome is not storage.Outcome.WON:
        holder.result()
        raise AssertionError(f"the holder did not win: {holder.outcome or holder.error}")
    try:
        yield holder
    finally:
        holder.result()


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


@contextlib.contextmanager
def traced_stores() -> Iterator[list[tuple[Any, Any]]]:
    """Trace each record store on the default connection (libpq trace): yields the list of
    (trace, transaction status just after the store), filled as stores happen."""
    import pytest

    from bench.round_trips import libpq_trace

    connection = connections[DEFAULT_DB_ALIAS]
    stores: list[tuple[Any, Any]] = []
    original = storage.store

    def store(*args: Any, **kwargs: Any) -> None:
        with libpq_trace(connection.connection.pgconn) as trace:
            original(*args, **kwargs)
        stores.append((trace, connection.connection.info.transaction_status))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(storage, "store", store)
        yield stores
