"""The cursors of the records' statements: kept per connection, dropped when they would hold a
large body or outlive their connection, and seen by whatever observes Django's cursors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper
from psycopg.pq import Format, TransactionStatus

from django_idempotency.storage import cursors
from testproject.payments.models import Charge
from tests.factories import TokenFactory, new_key
from tests.support.claims import body_of, claim, store_body
from tests.support.client import replayed


@pytest.fixture
def driver_statements(monkeypatch) -> list[tuple[str, psycopg.Cursor[Any]]]:
    """The records' statements as the driver runs them, each with its cursor."""
    seen: list[tuple[str, psycopg.Cursor[Any]]] = []
    execute = psycopg.Cursor.execute

    def spy(self: psycopg.Cursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        if "django_idempotency_" in str(query):
            seen.append((str(query).split("(", 1)[0], self))
        return execute(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", spy)
    return seen


def cursors_of(seen: list[tuple[str, psycopg.Cursor[Any]]], name: str) -> list[Any]:
    return [cursor for sql, cursor in seen if name in sql]


def claim_and_store(size: int = 100) -> str:
    key = new_key()
    with transaction.atomic():
        store_body("anonymous", key, body_of(size), commit=True)
    return key


def replay(key: str) -> bytes:
    with transaction.atomic():
        found = claim("anonymous", key)
    assert found.record is not None
    return found.record.body()


@pytest.mark.django_db(transaction=True)
def test_a_connection_runs_its_claims_and_stores_on_one_cursor_of_each_kind(
    driver_statements,
) -> None:
    keys = [claim_and_store(), claim_and_store()]
    assert [replay(key) for key in keys] == [body_of(100)] * 2
    claims = cursors_of(driver_statements, "claim")
    stores = cursors_of(driver_statements, "store")
    assert len(claims) == 4 and len(stores) == 2
    assert all(cursor is claims[0] for cursor in claims)
    assert stores[0] is stores[1]
    # Bound on the server with binary results; the store bound on the client, so that its
    # COMMIT travels in the same string.
    assert type(claims[0]) is psycopg.Cursor and claims[0].format == Format.BINARY
    assert type(stores[0]) is psycopg.ClientCursor


@pytest.mark.django_db(transaction=True)
def test_a_cursor_that_read_a_large_body_is_not_kept(driver_statements) -> None:
    large = claim_and_store(cursors.KEPT_RESULT_MAX_BYTES + 1)
    small = claim_and_store()
    assert replay(large) == body_of(cursors.KEPT_RESULT_MAX_BYTES + 1)
    assert replay(small) == body_of(100)
    assert replay(small) == body_of(100)
    *_, read_large, after_large, after_small = cursors_of(driver_statements, "claim")
    assert after_large is not read_large and read_large.closed
    assert after_small is after_large and not after_small.closed


@pytest.mark.django_db(transaction=True)
def test_a_new_connection_gets_new_cursors(driver_statements) -> None:
    key = claim_and_store()
    connection.close()
    assert replay(key) == body_of(100)
    claim_and_store()
    first_claim, *_, last_claim = cursors_of(driver_statements, "claim")
    assert last_claim is not first_claim
    assert last_claim.connection is connection.connection


@pytest.mark.django_db(transaction=True)
def test_a_connection_shared_by_threads_keeps_no_cursor(driver_statements) -> None:
    # Two threads on one kept cursor could each fetch the other's row.
    connection.inc_thread_sharing()
    try:
        key = claim_and_store()
        assert replay(key) == replay(key) == body_of(100)
    finally:
        connection.dec_thread_sharing()
    claims = cursors_of(driver_statements, "claim")
    # The spy holds every cursor, so no id is reused.
    assert len(claims) == 3 and len({id(cursor) for cursor in claims}) == 3


@pytest.fixture
def agent_patched_execute(monkeypatch) -> Iterator[list[str]]:
    """``CursorWrapper.execute`` replaced, as APM agents (Sentry's SDK) replace it."""
    seen: list[str] = []
    execute = CursorWrapper.execute

    def traced(self: CursorWrapper, sql: str, params: Any = None) -> Any:
        seen.append(sql.split("(", 1)[0])
        return execute(self, sql, params)

    monkeypatch.setattr(CursorWrapper, "execute", traced)
    yield seen


@pytest.mark.django_db(transaction=True)
def test_an_agent_that_patched_djangos_cursor_sees_every_statement(agent_patched_execute) -> None:
    key = claim_and_store()
    assert replay(key) == body_of(100)
    ours = [sql for sql in agent_patched_execute if "django_idempotency_" in sql]
    assert ours == [
        "SELECT * FROM django_idempotency_claim",
        "SELECT django_idempotency_store",
        "SELECT * FROM django_idempotency_claim",
    ]


@pytest.fixture
def server_side_binding(monkeypatch) -> Iterator[None]:
    """Django's connection made with OPTIONS {"server_side_binding": True}."""
    connection.close()
    options = {**connection.settings_dict.get("OPTIONS", {}), "server_side_binding": True}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connection.ensure_connection()
    yield
    connection.close()


@pytest.mark.django_db(transaction=True)
def test_the_store_and_its_commit_travel_as_one_string_under_server_side_binding(
    server_side_binding,
) -> None:
    # Django's cursors bind on the server here, and a statement bound on the server cannot
    # hold two commands: the store binds on the client whatever Django's cursors do.
    with connection.cursor() as cursor:
        assert not isinstance(cursor.cursor, psycopg.ClientCursor)
    key = new_key()
    with transaction.atomic():
        store_body("anonymous", key, body_of(100), commit=True)
        assert connection.connection.info.transaction_status == TransactionStatus.IDLE
    assert replay(key) == body_of(100)


@pytest.mark.django_db(transaction=True)
def test_a_charge_is_stored_and_replayed_over_http_under_server_side_binding(
    server_side_binding, client
) -> None:
    headers = {"Authorization": f"Token {TokenFactory().key}", "Idempotency-Key": new_key()}
    body = {"amount": 2499, "currency": "inr"}

    def charge() -> Any:
        return client.post("/api/charges/", body, content_type="application/json", headers=headers)

    first, again = charge(), charge()
    assert first.status_code == again.status_code == 201
    assert not replayed(first) and replayed(again)
    assert again.content == first.content
    assert Charge.objects.count() == 1
