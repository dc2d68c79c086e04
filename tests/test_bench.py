"""The benchmark's way of counting round trips (``bench.round_trips``): libpq's trace of a
real connection, where a round trip ends with ReadyForQuery and a statement with
CommandComplete."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from bench.round_trips import label, libpq_trace


@pytest.mark.django_db(transaction=True)
def test_trace_counts_statements_and_round_trips_of_a_real_connection() -> None:
    connection.ensure_connection()
    with libpq_trace(connection.connection.pgconn) as trace, connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.execute("BEGIN")
        # Two statements in one message, as the engine sends its store with COMMIT.
        cursor.execute("SELECT count(*) FROM django_idempotency_record; COMMIT")
    assert trace.statements == ["SELECT", "BEGIN", "SELECT", "COMMIT"]
    assert trace.round_trips == 3
    assert trace.sent == ["health check", "BEGIN", "lookup+COMMIT"]


@pytest.mark.django_db(transaction=True)
def test_trace_joins_the_statements_of_one_pipelined_round_trip() -> None:
    # As the engine sends its store (a statement with parameters) and COMMIT.
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
    pgconn = connection.connection
    with libpq_trace(pgconn.pgconn) as trace, pgconn.pipeline(), psycopg.Cursor(pgconn) as cursor:
        cursor.execute("SELECT count(*) FROM django_idempotency_record WHERE key = %s", ["k"])
        cursor.execute("COMMIT")
    assert trace.statements == ["SELECT", "COMMIT"]
    assert trace.round_trips == 1
    assert trace.sent == ["lookup+COMMIT"]


@pytest.mark.django_db(transaction=True)
def test_trace_sees_nothing_outside_its_block() -> None:
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        with libpq_trace(connection.connection.pgconn) as trace:
            pass
        cursor.execute("SELECT 1")
    assert (trace.statements, trace.sent, trace.round_trips) == ([], [], 0)


def test_labels_name_the_request_path_statements() -> None:
    assert label("SELECT * FROM django_idempotency_claim(1, 'a', 'k')") == "claim"
    assert label("SELECT django_idempotency_store('a', 'k'); COMMIT") == "store+COMMIT"
    assert label('SELECT "authtoken_token"."key" FROM "authtoken_token"') == "auth"
    assert label("UPDATE foo SET x = 1") == "UPDATE foo"
