"""The engine's signals fire with the documented kwargs, and a failing receiver is harmless."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.dispatch import Signal
from django.http import HttpRequest

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from tests.factories import ScriptFactory, new_key
from tests.support.claims import held_claim
from tests.support.client import send
from tests.support.views import ScriptedView

pytestmark = pytest.mark.urls("tests.support.urls")


class Received:
    """Every send of one signal: its kwargs, plus what the receiver saw of the database."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> None:
        kwargs["in_atomic_block"] = connection.in_atomic_block
        kwargs["records_visible"] = IdempotencyRecord.objects.filter(key=kwargs["key"]).count()
        self.calls.append(kwargs)

    @property
    def one(self) -> dict[str, Any]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0]


@pytest.fixture
def receive() -> Iterator[Any]:
    connected: list[tuple[Signal, Received]] = []

    def connect(signal: Signal) -> Received:
        received = Received()
        signal.connect(received, weak=False)
        connected.append((signal, received))
        return received

    yield connect
    for signal, received in connected:
        signal.disconnect(received)


@pytest.mark.django_db(transaction=True)
def test_response_stored_fires_after_commit_with_request_key_principal_status(
    client, receive: Any
) -> None:
    stored = receive(signals.response_stored)
    key = new_key()
    send(client, "POST", "/drf/", ScriptFactory(status=202), key=key)
    call = stored.one
    assert set(call) == {
        "signal", "sender", "request", "key", "principal", "status",
        "in_atomic_block", "records_visible",
    }  # fmt: skip
    assert call["sender"] is ScriptedView
    assert isinstance(call["request"], HttpRequest)
    assert (call["key"], call["principal"], call["status"]) == (key, "anonymous", 202)
    # Sent outside the transaction, once the record is committed.
    assert call["in_atomic_block"] is False
    assert call["records_visible"] == 1


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
@pytest.mark.parametrize("script", [{"status": 429}, {"fail": "status", "fail_status": 500}])
def test_response_stored_is_not_sent_when_nothing_is_stored(
    client, receive: Any, path: str, script: dict[str, Any]
) -> None:
    stored = receive(signals.response_stored)
    send(client, "POST", path, ScriptFactory(**script), key=new_key())
    assert stored.calls == []


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_response_replayed_fires_with_request_key_principal_status(
    client, receive: Any, path: str
) -> None:
    replayed = receive(signals.response_replayed)
    key, script = new_key(), ScriptFactory(status=200)
    send(client, "POST", path, script, key=key)
    assert replayed.calls == []
    send(client, "POST", path, script, key=key)
    call = replayed.one
    assert set(call) >= {"request", "key", "principal", "status"}
    assert (call["key"], call["principal"], call["status"]) == (key, "anonymous", 200)
    assert isinstance(call["request"], HttpRequest)


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_key_reused_fires_with_the_differing_parts(client, receive: Any, path: str) -> None:
    reused = receive(signals.key_reused)
    key, script = new_key(), ScriptFactory()
    send(client, "POST", path, script, key=key)
    send(client, "POST", path + "?page=2", {**script, "amount": 1}, key=key)
    call = reused.one
    assert set(call) >= {"request", "key", "principal", "differing"}
    assert (call["key"], call["principal"]) == (key, "anonymous")
    assert call["differing"] == ["query", "body"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_request_conflicted_fires_with_how_long_the_duplicate_waited(
    client, receive: Any, path: str, waiting_on_main_thread: None
) -> None:
    conflicted = receive(signals.request_conflicted)
    key = new_key()
    with held_claim("anonymous", key):
        response = send(
            client, "POST", path, ScriptFactory(), key=key, headers={"Prefer": "wait=1"}
        )
    assert response.status_code == 409
    call = conflicted.one
    assert set(call) >= {"request", "key", "principal", "waited"}
    assert (call["key"], call["principal"]) == (key, "anonymous")
    assert isinstance(call["waited"], float)
    # It waited (about) the second it was allowed, and gave up.
    assert 0.5 <= call["waited"] < 30


@pytest.mark.django_db
def test_a_failing_receiver_never_fails_the_request(client, receive: Any) -> None:
    def explode(**kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    for signal in (signals.response_stored, signals.response_replayed, signals.key_reused):
        signal.connect(explode, weak=False)
    try:
        key, script = new_key(), ScriptFactory()
        assert send(client, "POST", "/drf/", script, key=key).status_code == 201
        assert send(client, "POST", "/drf/", script, key=key).status_code == 201
        assert send(client, "POST", "/drf/", {**script, "x": 1}, key=key).status_code == 422
    finally:
        for signal in (signals.response_stored, signals.response_replayed, signals.key_reused):
            signal.disconnect(explode)


def test_the_library_connects_no_receivers_of_its_own() -> None:
    for signal in (
        signals.response_replayed, signals.key_reused, signals.request_conflicted,
        signals.response_stored, signals.partitions_created, signals.partitions_dropped,
    ):  # fmt: skip
        assert not signal.has_listeners()
