"""``@idempotent`` for plain Django views: its keyword overrides and its place in a stack."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.http import HttpRequest, JsonResponse
from django.test import Client, RequestFactory

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.claims import held_claim
from tests.client import problem, send
from tests.factories import ScriptFactory, UserFactory, new_key
from tests.views import CALLS

pytestmark = pytest.mark.django_db


def counted(request: HttpRequest) -> JsonResponse:
    """A plain view counting its runs under the ``tag`` query parameter."""
    return JsonResponse({"execution": CALLS.hit(request.GET["tag"])}, status=201)


def call(view: Any, *, key: str | None, tag: str, body: Any = None, **headers: str) -> Any:
    if key is not None:
        headers["Idempotency-Key"] = key
    request = RequestFactory().post(
        f"/counted/?tag={tag}", json.dumps(body or {}), content_type="application/json",
        headers=headers,
    )  # fmt: skip
    request.user = AnonymousUser()
    return view(request)


def test_decorator_keeps_the_view_name_and_docstring() -> None:
    assert idempotent(counted).__name__ == "counted"
    assert idempotent(ttl=timedelta(hours=1))(counted).__doc__ == counted.__doc__
    assert idempotent(counted).__wrapped__ is counted


def test_bare_decorator_and_decorator_with_no_arguments_behave_the_same() -> None:
    for view in (idempotent(counted), idempotent()(counted)):
        key, tag = new_key(), new_key()
        call(view, key=key, tag=tag)
        assert call(view, key=key, tag=tag)["Idempotent-Replayed"] == "true"
        assert CALLS[tag] == 1


def test_ttl_keyword_sets_the_expiry_within_max_ttl() -> None:
    key = new_key()
    call(idempotent(ttl=timedelta(hours=3))(counted), key=key, tag=new_key())
    record = IdempotencyRecord.objects.get(key=key)
    assert record.expires_at - record.created_at == timedelta(hours=3)
    key = new_key()
    call(idempotent(ttl=timedelta(days=3))(counted), key=key, tag=new_key())
    record = IdempotencyRecord.objects.get(key=key)
    assert record.expires_at - record.created_at == timedelta(hours=24)


def test_wait_keyword_sets_how_long_a_duplicate_waits() -> None:
    key, tag = new_key(), new_key()
    with held_claim("anonymous", key):
        response = call(idempotent(wait=timedelta(0))(counted), key=key, tag=tag)
    assert response.status_code == 409
    assert problem(response)["type"].endswith("in-progress")
    assert CALLS[tag] == 0


def test_fingerprint_headers_keyword_names_meaningful_headers() -> None:
    view = idempotent(fingerprint_headers=["X-Account"])(counted)
    key, tag = new_key(), new_key()
    call(view, key=key, tag=tag, **{"X-Account": "acct_1"})
    response = call(view, key=key, tag=tag, **{"X-Account": "acct_2"})
    assert response.status_code == 422
    assert problem(response)["differing"] == ["header:x-account"]


def test_required_and_methods_keywords() -> None:
    required = idempotent(required=True)(counted)
    assert call(required, key=None, tag=new_key()).status_code == 400
    patch_only = idempotent(methods=["PATCH"])(counted)
    key, tag = new_key(), new_key()
    call(patch_only, key=key, tag=tag)
    call(patch_only, key=key, tag=tag)
    assert CALLS[tag] == 2


@pytest.mark.urls("tests.urls")
def test_login_required_outside_runs_before_a_replay() -> None:
    user, key, script = UserFactory(), new_key(), ScriptFactory()
    logged_in = Client()
    logged_in.force_login(user)
    first = send(logged_in, "POST", "/plain/login/", script, key=key)
    assert first.status_code == 201

    anonymous = send(Client(), "POST", "/plain/login/", script, key=key)
    assert anonymous.status_code == 302
    assert "Idempotent-Replayed" not in anonymous

    retry = send(logged_in, "POST", "/plain/login/", script, key=key)
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1


@pytest.mark.urls("tests.urls")
@pytest.mark.parametrize(
    ("suffix", "key", "body_change"),
    [("required/", None, {}), ("", "bad key", {}), ("", "good-key", {"x": 1})],
)
def test_decorator_and_mixin_produce_the_same_errors(
    client, suffix: str, key: str | None, body_change: dict[str, Any]
) -> None:
    # One module turns engine errors into responses for both glues.
    bodies = []
    for prefix in ("/drf/", "/plain/"):
        script = {"tag": "same-errors"}
        if key == "good-key":
            own_key = new_key()
            send(client, "POST", prefix, script, key=own_key)
            response = send(client, "POST", prefix, {**script, **body_change}, key=own_key)
        else:
            response = send(client, "POST", prefix + suffix, script, key=key)
        bodies.append((response.status_code, problem(response)))
    assert bodies[0] == bodies[1]


@pytest.mark.urls("tests.urls")
@pytest.mark.parametrize(("reject", "status"), [("raise404", 404), ("forbidden", 403)])
def test_http404_and_permission_denied_are_stored_and_replayed_like_drf(
    client, reject: str, status: int
) -> None:
    key, script = new_key(), ScriptFactory(reject=reject)
    first = send(client, "POST", "/plain/", script, key=key)
    retry = send(client, "POST", "/plain/", script, key=key)
    assert first.status_code == status
    assert retry.status_code == status
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1
