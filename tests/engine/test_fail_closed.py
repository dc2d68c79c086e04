"""A covered request whose database is gone before the claim gets 503 store-unavailable,
even when authentication is what first needs the database."""

from __future__ import annotations

import pytest
from django.db import OperationalError, connection

from tests.factories import ScriptFactory, UserFactory, new_key
from tests.support.client import problem, send
from tests.support.views import CALLS

pytestmark = [pytest.mark.urls("tests.support.urls"), pytest.mark.django_db(transaction=True)]


@pytest.fixture
def database_down(monkeypatch: pytest.MonkeyPatch):
    # Nothing listens on port 1: the next query opens a connection that is refused.
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
    monkeypatch.setitem(connection.settings_dict, "PORT", "1")
    yield
    connection.close()


def test_token_authentication_on_a_dead_database_is_503_and_the_view_does_not_run(
    client, database_down
) -> None:
    script = ScriptFactory()
    response = send(
        client, "POST", "/drf/", script, key=new_key(),
        headers={"Authorization": "Token " + "a" * 40},
    )  # fmt: skip
    assert response.status_code == 503
    assert problem(response)["type"].endswith("store-unavailable")
    assert int(response["Retry-After"]) >= 1
    assert CALLS[script["tag"]] == 0


@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_session_user_on_a_dead_database_is_503_and_the_view_does_not_run(
    client, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    client.force_login(UserFactory())
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
    monkeypatch.setitem(connection.settings_dict, "PORT", "1")
    script = ScriptFactory()
    response = send(client, "POST", path, script, key=new_key())
    connection.close()
    assert response.status_code == 503
    assert problem(response)["type"].endswith("store-unavailable")
    assert CALLS[script["tag"]] == 0


def test_without_a_key_the_request_is_not_ours_to_answer(client, database_down) -> None:
    # Uncovered requests keep Django's and DRF's own behaviour.
    with pytest.raises(OperationalError):
        send(client, "POST", "/drf/", ScriptFactory(), headers={"Authorization": "Token x"})
