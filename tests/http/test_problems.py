"""Section 9: every error the app produces, as problem+json and as Stripe's error object."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from django_idempotency.engine import errors as exceptions
from django_idempotency.http.problems import problem_response
from django_idempotency.models import IdempotencyRecord
from tests.factories import ScriptFactory, new_key
from tests.support.claims import held_claim, unreachable_store
from tests.support.client import send

pytestmark = [pytest.mark.urls("tests.support.urls"), pytest.mark.django_db]


def missing_key(client: Any, path: str, settings: Any) -> Any:
    return send(client, "POST", path + "required/", ScriptFactory())


def invalid_key(client: Any, path: str, settings: Any) -> Any:
    return send(client, "POST", path, ScriptFactory(), key="two words")


def key_reused(client: Any, path: str, settings: Any) -> Any:
    key, script = new_key(), ScriptFactory()
    send(client, "POST", path, script, key=key)
    return send(client, "POST", path, {**script, "amount": 2}, key=key)


def in_progress(client: Any, path: str, settings: Any) -> Any:
    key = new_key()
    with held_claim("anonymous", key):
        return send(client, "POST", path, ScriptFactory(), key=key, headers={"Prefer": "wait=0"})


def key_expired(client: Any, path: str, settings: Any) -> Any:
    settings.IDEMPOTENCY_EXPIRED_WINDOW = timedelta(hours=1)
    key, script = new_key(), ScriptFactory()
    send(client, "POST", path, script, key=key)
    record = IdempotencyRecord.objects.get(key=key)
    record.expires_at = record.created_at - timedelta(minutes=1)
    record.save(update_fields=["expires_at"])
    return send(client, "POST", path, script, key=key)


def store_unavailable(client: Any, path: str, settings: Any) -> Any:
    with unreachable_store(settings):
        return send(client, "POST", path, ScriptFactory(), key=new_key())


PROBLEMS: dict[str, tuple[Callable[..., Any], int]] = {
    "missing-key": (missing_key, 400),
    "invalid-key": (invalid_key, 400),
    "key-reused": (key_reused, 422),
    "in-progress": (in_progress, 409),
    "key-expired": (key_expired, 410),
    "store-unavailable": (store_unavailable, 503),
}
each_problem = pytest.mark.parametrize(
    ("name", "provoke", "status"),
    [(name, provoke, status) for name, (provoke, status) in PROBLEMS.items()],
    ids=list(PROBLEMS),
)
ENDPOINTS = pytest.mark.parametrize("path", ["/drf/", "/plain/"])


@each_problem
@ENDPOINTS
def test_every_problem_is_problem_json_with_type_title_status_detail_and_no_store(
    client, settings, path: str, name: str, provoke: Callable[..., Any], status: int
) -> None:
    response = provoke(client, path, settings)
    assert response.status_code == status
    assert response["Content-Type"] == "application/problem+json"
    assert response["Cache-Control"] == "no-store"
    body = json.loads(response.content)
    assert body["type"] == "urn:django-idempotency:" + name
    assert body["status"] == status
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]


@each_problem
def test_every_problem_is_served_to_a_drf_client_accepting_only_problem_json(
    client, settings, name: str, provoke: Callable[..., Any], status: int
) -> None:
    original = client.generic

    def generic(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("headers", {})["Accept"] = "application/problem+json"
        return original(*args, **kwargs)

    client.generic = generic
    response = provoke(client, "/drf/", settings)
    assert response.status_code == status
    assert response["Content-Type"] == "application/problem+json"


@pytest.mark.parametrize("name", ["in-progress", "store-unavailable"])
@ENDPOINTS
def test_retryable_problems_carry_retry_after_in_whole_seconds(
    client, settings, path: str, name: str
) -> None:
    response = PROBLEMS[name][0](client, path, settings)
    assert int(response["Retry-After"]) >= 1


def test_key_reused_problem_names_the_differing_parts(client, settings) -> None:
    body = json.loads(key_reused(client, "/drf/", settings).content)
    assert body["differing"] == ["body"]


def test_problem_type_base_is_configurable(client, settings) -> None:
    settings.IDEMPOTENCY_PROBLEM_TYPE_BASE = "https://docs.example.com/errors/"
    body = json.loads(invalid_key(client, "/drf/", settings).content)
    assert body["type"] == "https://docs.example.com/errors/invalid-key"


def test_the_views_own_4xx_is_not_turned_into_a_problem(client) -> None:
    response = send(client, "POST", "/drf/", ScriptFactory(reject="invalid"), key=new_key())
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"


STRIPE = {
    "missing-key": (400, "invalid_request_error"),
    "invalid-key": (400, "invalid_request_error"),
    "key-reused": (400, "idempotency_error"),
    "in-progress": (409, "invalid_request_error"),
    "key-expired": (410, "invalid_request_error"),
    "store-unavailable": (503, "api_error"),
}


@pytest.mark.parametrize("name", list(STRIPE))
@ENDPOINTS
def test_stripe_preset_gives_stripe_error_objects(client, settings, path: str, name: str) -> None:
    settings.IDEMPOTENCY_ERROR_FORMAT = "stripe"
    response = PROBLEMS[name][0](client, path, settings)
    status, error_type = STRIPE[name]
    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    assert response["Cache-Control"] == "no-store"
    error = json.loads(response.content)["error"]
    assert error["type"] == error_type
    assert isinstance(error["message"], str) and error["message"]


def test_stripe_preset_key_in_use_is_409_idempotency_key_in_use(client, settings) -> None:
    settings.IDEMPOTENCY_ERROR_FORMAT = "stripe"
    response = in_progress(client, "/drf/", settings)
    assert response.status_code == 409
    assert json.loads(response.content)["error"]["code"] == "idempotency_key_in_use"
    assert int(response["Retry-After"]) >= 1


def test_stripe_preset_reuse_is_400_idempotency_error(client, settings) -> None:
    settings.IDEMPOTENCY_ERROR_FORMAT = "stripe"
    response = key_reused(client, "/plain/", settings)
    assert response.status_code == 400
    assert json.loads(response.content)["error"]["type"] == "idempotency_error"


@pytest.mark.parametrize(
    "error_class",
    [
        exceptions.MissingKey,
        exceptions.InvalidKey,
        exceptions.KeyReused,
        exceptions.InProgress,
        exceptions.KeyExpired,
        exceptions.StoreUnavailable,
    ],
)
def test_problem_response_carries_the_errors_headers(error_class: Any) -> None:
    error = error_class("Something happened.")
    error.headers["Retry-After"] = "3"
    response = problem_response(error)
    assert response.status_code == error_class.status
    assert response["Retry-After"] == "3"
    assert json.loads(response.content)["detail"] == "Something happened."
