"""The benchmark's way of counting round trips (``bench.round_trips``): libpq's trace of a
real connection, where a round trip ends with ReadyForQuery and a statement with
CommandComplete."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

from bench.floor import (
    FLOOR_CANNED,
    FLOOR_FRESH,
    FLOOR_FRESH_STATEMENTS,
    FLOOR_REPLAY,
    FLOOR_REPLAY_STATEMENTS,
)
from bench.floor import PATHS as FLOOR_PATHS
from bench.round_trips import label, libpq_trace
from tests.factories import TokenFactory, new_key


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


def test_labels_name_the_lookup_and_any_statement_sent_with_its_commit() -> None:
    assert label("SELECT * FROM django_idempotency_lookup('a', 'k', '1 day')") == "lookup"
    assert label("SELECT 'store'; COMMIT") == "SELECT 'store'+COMMIT"


def test_labels_name_a_statement_sent_with_its_begin() -> None:
    assert label("BEGIN; SELECT * FROM django_idempotency_claim(1, 'a', 'k')") == "BEGIN+claim"


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF="bench.floor_views")
def test_each_floor_makes_the_round_trips_of_the_request_it_stands_for(client) -> None:
    """The request benchmark's floors (bench/floor.py) stand for a protected request's round
    trips: the same number, the claim and the store in the same places."""
    headers = {"Authorization": f"Token {TokenFactory().key}"}
    body = {"amount": 2499, "currency": "inr"}
    connection.ensure_connection()

    def sent(path: str, key: str | None = None) -> tuple[list[str], int]:
        extra = headers if key is None else {**headers, "Idempotency-Key": key}
        with libpq_trace(connection.connection.pgconn) as trace:
            response = client.post(path, body, content_type="application/json", headers=extra)
        assert response.status_code == 201, response.content
        return trace.sent, trace.round_trips

    key = new_key()
    fresh, replay = sent("/api/charges/", key), sent("/api/charges/", key)
    floor_fresh = sent(FLOOR_PATHS[FLOOR_FRESH])
    floor_replay = sent(FLOOR_PATHS[FLOOR_REPLAY])
    standing_for = {
        "lookup": "SELECT 'lookup'",
        "BEGIN+claim": "BEGIN+SELECT 'claim'",
        "store+COMMIT": "SELECT 'store'+COMMIT",
    }
    assert [standing_for.get(name, name) for name in fresh[0]] == floor_fresh[0]
    assert [standing_for.get(name, name) for name in replay[0]] == floor_replay[0]
    assert fresh[1] == floor_fresh[1] and replay[1] == floor_replay[1]
    assert sent(FLOOR_PATHS[FLOOR_CANNED]) == (["auth"], 1)
    # The statement floors send the very statements, without the engine.
    floor_key = new_key()
    assert sent(FLOOR_PATHS[FLOOR_FRESH_STATEMENTS], floor_key) == fresh
    assert sent(FLOOR_PATHS[FLOOR_REPLAY_STATEMENTS], floor_key) == replay


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF="bench.floor_views")
def test_the_statement_floors_store_and_replay_a_real_record(client) -> None:
    headers = {"Authorization": f"Token {TokenFactory().key}", "Idempotency-Key": new_key()}
    body = {"amount": 2499, "currency": "inr"}

    def post(floor: str) -> Any:
        path = FLOOR_PATHS[floor]
        return client.post(path, body, content_type="application/json", headers=headers)

    first = post(FLOOR_FRESH_STATEMENTS)
    again = post(FLOOR_REPLAY_STATEMENTS)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.content == first.content and again["Content-Type"] == first["Content-Type"]
    assert again["Idempotent-Replayed"] == "true"
    # The key is claimed: the fresh floor refuses it as the engine would replay it.
    assert post(FLOOR_FRESH_STATEMENTS).status_code == 409
