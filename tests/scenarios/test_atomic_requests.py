"""Under ATOMIC_REQUESTS the view runs in a savepoint: DRF's set_rollback() undoes the
view's writes, and the 4xx is still stored and replayed, as it is without ATOMIC_REQUESTS."""

from __future__ import annotations

import pytest
from django.db import connection

from django_idempotency.models import IdempotencyRecord
from tests.factories import ScriptFactory, new_key
from tests.support.client import replayed, send
from tests.support.views import CALLS, business_rows

pytestmark = [pytest.mark.urls("tests.support.urls"), pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)


def test_drf_validation_error_is_stored_and_replayed(client) -> None:
    key, script = new_key(), ScriptFactory(reject="invalid")
    first = send(client, "POST", "/drf/", script, key=key)
    retry = send(client, "POST", "/drf/", script, key=key)
    assert first.status_code == 400
    assert not replayed(first)
    assert replayed(retry)
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1
    assert IdempotencyRecord.objects.filter(key=key, response_code=400).count() == 1


def test_success_commits_the_write_and_the_record(client) -> None:
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", "/drf/", script, key=key)
    assert first.status_code == 201
    assert business_rows(script["tag"]) == 1
    assert IdempotencyRecord.objects.filter(key=key, response_code=201).count() == 1


def test_a_500_rolls_back_the_write_and_the_record(client) -> None:
    key, script = new_key(), ScriptFactory(fail="status", fail_status=500)
    first = send(client, "POST", "/drf/", script, key=key)
    assert first.status_code == 500
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
