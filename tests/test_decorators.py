"""``@idempotent`` for plain Django views: its keyword overrides and its place in a stack."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.http import HttpRequest, JsonResponse
from django.test import Client, RequestFactory

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.factories import ScriptFactory, UserFactory, new_key
from tests.support.claims import held_claim
from tests.support.client import problem, send
from tests.support.views import CALLS

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
    request.user = caller()
    return view(request)


def caller() -> Any:
    """The user the requests of ``call()`` come from: an anonymous caller's key is refused
    on a view that did not opt in to anonymous keys."""
    from django.contrib.auth import get_user_model

    return get_user_model().objects.get_or_create(username="caller")[0]


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
    with held_claim(f"user:{caller().pk}", key):
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


@pytest.mark.urls("tests.support.urls")
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


@pytest.mark.urls("tests.support.urls")
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


@pytest.mark.urls("tests.support.urls")
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


# @idempotent above the view's own authentication (contract 3, 15): over HTTP, the misplaced
# decorator answers 500 misconfigured to a client with credentials and stores nothing, so
# neither another user nor a client without credentials ever gets the first one's response.


@pytest.fixture(scope="module")
def views_server(
    gunicorn_server: Any, django_db_blocker: Any, django_db_setup: None
) -> Iterator[str]:
    """gunicorn (1 worker, 4 threads) serving the test-only views (``tests.support.urls``)."""
    env = {"DJANGO_SETTINGS_MODULE": "tests.support.views_settings"}
    with gunicorn_server(workers=1, threads=4, env=env) as server:
        yield server.url


def post_iban(base_url: str, path: str, key: str, user: Any = None) -> requests.Response:
    headers = {"Idempotency-Key": key}
    if user is not None:
        headers["Authorization"] = f"Token {user.token}"
    return requests.post(f"{base_url}{path}", json={}, headers=headers, timeout=30)


@pytest.mark.parametrize("path", ["/iban/above-token-required/", "/iban/above-api-view/"])
@pytest.mark.django_db(transaction=True)
def test_idempotent_above_authentication_never_replays_one_users_response_to_another(
    views_server: str, make_token_user: Any, path: str
) -> None:
    alice, bob = make_token_user("alice"), make_token_user("bob")
    key = new_key()
    first = post_iban(views_server, path, key, alice)
    assert first.status_code == 500, first.text
    assert first.json()["type"].endswith("misconfigured")
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    answers = [post_iban(views_server, path, key, bob), post_iban(views_server, path, key)]
    print([(a.status_code, a.text[:80]) for a in answers])
    for answer in answers:
        assert "DE89" not in answer.text and "alice" not in answer.text
        assert answer.headers.get("Idempotent-Replayed") != "true"
    # Bob with his credentials, and a client with none: refused before the claim alike, so
    # no 401 is stored under a shared anonymous scope either.
    assert [a.status_code for a in answers] == [500, 500]
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def post_api_key(base_url: str, path: str, key: str, api_key: str | None) -> requests.Response:
    headers = {"Idempotency-Key": key}
    if api_key is not None:
        headers["X-Api-Key"] = api_key
    return requests.post(f"{base_url}{path}", json={}, headers=headers, timeout=30)


@pytest.mark.django_db(transaction=True)
def test_a_view_authenticating_by_api_key_after_the_claim_replays_nobody_anything(
    views_server: str,
) -> None:
    # Issue 29: Alice's 201 was replayed to Bob, to a client with no API key and to one with
    # a wrong key, and a 401 was stored under the shared anonymous scope.
    key = new_key()
    answers = {
        who: post_api_key(views_server, "/api-key/above/", key, api_key)
        for who, api_key in [("alice", "alice-key"), ("bob", "bob-key"), ("none", None),
                             ("wrong", "wrong-key"), ("alice again", "alice-key")]
    }  # fmt: skip
    for who, answer in answers.items():
        assert answer.status_code == 500, (who, answer.text)
        assert answer.json()["type"].endswith("misconfigured")
        assert answer.headers.get("Idempotent-Replayed") != "true"
    assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.django_db(transaction=True)
def test_a_principal_callable_below_the_api_key_check_scopes_each_client(
    views_server: str,
) -> None:
    key = new_key()
    alice = post_api_key(views_server, "/api-key/scoped/", key, "alice-key")
    bob = post_api_key(views_server, "/api-key/scoped/", key, "bob-key")
    retry = post_api_key(views_server, "/api-key/scoped/", key, "alice-key")
    refused = [post_api_key(views_server, "/api-key/scoped/", key, k) for k in (None, "wrong")]
    assert (alice.status_code, bob.status_code) == (201, 201)
    assert alice.json()["client"] == "alice" and bob.json()["client"] == "bob"
    assert retry.headers.get("Idempotent-Replayed") == "true" and retry.json() == alice.json()
    assert [r.status_code for r in refused] == [401, 401]
    scopes = set(IdempotencyRecord.objects.filter(key=key).values_list("scope", flat=True))
    assert scopes == {"client:alice", "client:bob"}


@pytest.mark.parametrize("path", ["/iban/below-token-required/", "/iban/below-api-view/"])
@pytest.mark.django_db(transaction=True)
def test_idempotent_below_authentication_scopes_each_users_key_to_them(
    views_server: str, make_token_user: Any, path: str
) -> None:
    alice, bob = make_token_user("alice"), make_token_user("bob")
    key = new_key()
    first = post_iban(views_server, path, key, alice)
    retry = post_iban(views_server, path, key, alice)
    other = post_iban(views_server, path, key, bob)
    assert first.status_code == 200 and first.json()["owner"] == "alice"
    assert retry.headers["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert other.json()["owner"] == "bob" and "Idempotent-Replayed" not in other.headers
    assert post_iban(views_server, path, key).status_code == 401


# A setting of the wrong type on the request path: refused as misconfigured (an error log
# naming the setting), never a traceback or a value read as something else.


@pytest.mark.urls("tests.support.urls")
@pytest.mark.parametrize(
    ("setting", "value"),
    [("IDEMPOTENCY_TTL", 3600), ("IDEMPOTENCY_REQUIRED", "False"),
     ("IDEMPOTENCY_PRINCIPAL", "nowhere.principal"),
     ("IDEMPOTENCY_PRINCIPAL", "tests.support.views.CALLS")],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/plain/", "/drf/", "/adrf/", "/ninja/open/"])
def test_a_setting_of_the_wrong_type_refuses_idempotent_requests_as_misconfigured(
    path: str, setting: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    if path.startswith("/ninja/"):
        pytest.importorskip("ninja")
    from django.test import override_settings

    script = ScriptFactory()
    with override_settings(**{setting: value}):
        response = send(Client(), "POST", f"{path}?tag={script['tag']}", script, key=new_key())
    assert response.status_code == 500
    assert problem(response)["type"].endswith("misconfigured")
    assert CALLS[script["tag"]] == 0
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(setting in message for message in logged), logged


@pytest.mark.urls("tests.support.urls")
def test_a_method_decorator_view_keeps_one_policy_however_many_requests() -> None:
    # method_decorator() decorates a new partial of the method on every request: each one
    # cached a policy, holding its request, for ever.
    from django_idempotency.http import options

    client = Client()
    first = send(client, "POST", "/cbv/method-decorated/", ScriptFactory(), key=new_key())
    assert first.status_code == 201
    cached = len(options._policies)
    for _ in range(5):
        send(client, "POST", "/cbv/method-decorated/", ScriptFactory(), key=new_key())
    assert len(options._policies) == cached
