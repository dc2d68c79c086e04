"""Writes that ride with the store: an outbox row sent in the statement that stores a unit's
record and commits, inside a unit that owns its transaction (``docs/outbox.md``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from django.db import connections, transaction


class _Marker:
    """An ``on_commit`` no-op: Django forgets it when its savepoint rolls back, which tells
    the store that the write it marks was undone."""

    __slots__ = ()

    def __call__(self) -> None:
        pass


class Riders:
    """The writes waiting for one unit of work's store, on one database."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.thread = threading.get_ident()
        self.open = True
        self._writes: list[tuple[str, list[Any], _Marker]] = []

    def add(self, sql: str, params: list[Any]) -> None:
        marker = _Marker()
        transaction.on_commit(marker, using=self.using)
        self._writes.append((sql, params, marker))

    def close(self) -> list[tuple[str, list[Any]]]:
        """Stop taking writes; return those not undone by a savepoint's rollback."""
        self.open = False
        if not self._writes:
            return []
        # Django keeps an on_commit callback only while every savepoint around it stands.
        kept = {id(func) for _, func, *_ in connections[self.using].run_on_commit}
        return [(sql, params) for sql, params, marker in self._writes if id(marker) in kept]


riders_waiting: ContextVar[Riders | None] = ContextVar("django_idempotency_riders", default=None)


@contextlib.contextmanager
def riding(using: str, *, commits: bool) -> Iterator[list[tuple[str, list[Any]]]]:
    """While the block runs (a unit of work's work), writes on ``using`` that can wait ride
    with the store (``ride()``); once it has run, the yielded list holds those to send with
    it. Only where the store commits the transaction itself, on PostgreSQL."""
    kept: list[tuple[str, list[Any]]] = []
    if not commits or connections[using].vendor != "postgresql":
        yield kept
        return
    riders = Riders(using)
    # set(), not a token's reset(): an async view's work ends in another context.
    outer = riders_waiting.get()
    riders_waiting.set(riders)
    try:
        yield kept
    finally:
        riders_waiting.set(outer)
        kept += riders.close()


def ride(using: str, sql: str, params: list[Any]) -> bool:
    """Leave a write to travel with the running unit's store on ``using``, if there is one;
    False means the caller must execute it now."""
    riders = riders_waiting.get()
    if (
        riders is None
        or not riders.open
        or riders.using != using
        or riders.thread != threading.get_ident()
    ):
        return False
    riders.add(sql, params)
    return True


def write(using: str, sql: str, params: list[Any]) -> None:
    """Execute a write in the caller's transaction on ``using``: with the running unit's
    store when there is one (one round trip with it), else now."""
    if not ride(using, sql, params):
        with connections[using].cursor() as cursor:
            cursor.execute(sql, params)
