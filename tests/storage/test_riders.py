"""Writes that ride with the store (``storage.riders``): which wait, and which are sent."""

from __future__ import annotations

import contextlib
import threading

import pytest
from django.db import DEFAULT_DB_ALIAS, transaction

from django_idempotency.storage.riders import ride, riding

pytestmark = pytest.mark.django_db

WRITE = ("SELECT %s", [1])


def test_outside_a_unit_nothing_waits() -> None:
    assert ride(DEFAULT_DB_ALIAS, *WRITE) is False


def test_where_the_store_does_not_commit_nothing_waits() -> None:
    with riding(DEFAULT_DB_ALIAS, commits=False) as kept:
        assert ride(DEFAULT_DB_ALIAS, *WRITE) is False
    assert kept == []


def test_a_write_on_the_units_database_and_thread_rides_until_the_block_ends() -> None:
    with riding(DEFAULT_DB_ALIAS, commits=True) as kept:
        assert ride(DEFAULT_DB_ALIAS, *WRITE) is True
        assert ride("other", *WRITE) is False  # another database: written at once
        elsewhere: list[bool] = []
        thread = threading.Thread(target=lambda: elsewhere.append(ride(DEFAULT_DB_ALIAS, *WRITE)))
        thread.start()
        thread.join()
        assert elsewhere == [False]  # another thread (an async view's ORM thread)
        assert kept == []  # filled once the work has run
    assert kept == [WRITE]
    assert ride(DEFAULT_DB_ALIAS, *WRITE) is False  # the unit is over


def test_a_write_in_a_savepoint_that_rolled_back_is_dropped_and_others_kept() -> None:
    with riding(DEFAULT_DB_ALIAS, commits=True) as kept:
        ride(DEFAULT_DB_ALIAS, "SELECT 'kept'", [])
        with contextlib.suppress(ZeroDivisionError), transaction.atomic():
            ride(DEFAULT_DB_ALIAS, "SELECT 'undone'", [])
            1 / 0  # noqa: B018
        with transaction.atomic():
            ride(DEFAULT_DB_ALIAS, "SELECT 'released'", [])
    assert kept == [("SELECT 'kept'", []), ("SELECT 'released'", [])]


def test_the_outer_blocks_riders_are_back_once_an_inner_block_ends() -> None:
    with riding(DEFAULT_DB_ALIAS, commits=True) as outer:
        with riding(DEFAULT_DB_ALIAS, commits=True) as inner:
            ride(DEFAULT_DB_ALIAS, "SELECT 'inner'", [])
        ride(DEFAULT_DB_ALIAS, "SELECT 'outer'", [])
    assert (inner, outer) == ([("SELECT 'inner'", [])], [("SELECT 'outer'", [])])
