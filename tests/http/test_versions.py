"""Response versions (contract 8): a record stored under another version than the view's is
never replayed, and the same request on it gets 410 response-version-changed (nothing runs)
unless the view opted in to running anew; over HTTP on the payments API, the decorator and
the settings, and on live servers of several versions at once (a rolling deploy)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.http import HttpRequest, JsonResponse
from django.test import override_settings
from django.urls import path

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from testproject.payments.models import Charge
from testproject.payments.views import ChargeCreateView
from tests.conftest import GunicornServer, TokenUser
from tests.factories import new_key
from tests.support.chain_processes import wait_for
from tests.support.client import problem, replayed
from tests.support.payments import counts, post

pytestmark = pytest.mark.django_db

CHARGE = {"amount": 2499, "currency": "inr"}
RUNS: list[str] = []


# Anonymous keys on purpose: the tests' clients are anonymous, and each key is fresh.
@idempotent(response_version="v1", allow_anonymous=True)
def versioned(request: HttpRequest) -> JsonResponse:
    RUNS.append(request.path)
    return JsonResponse({"run": len(RUNS)}, status=201)


@idempotent(allow_anonymous=True)
def unversioned(request: HttpRequest) -> JsonResponse:
    RUNS.append(request.path)
    return JsonResponse({"run": len(RUNS)}, status=201)


urlpatterns = [path("versioned/", versioned), path("unversioned/", unversioned)]


def charge(client: Any, key: str) -> Any:
    return client.post("/api/charges/", CHARGE, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_the_charges_view_stores_its_version_and_replays_within_it(api_client: Any) -> None:
    key = new_key()
    first = charge(api_client, key)
    retry = charge(api_client, key)

    assert first.status_code == 201 and not replayed(first)
    assert replayed(retry) and retry.content == first.content
    assert IdempotencyRecord.objects.get(key=key).response_version == "2026-11"


def test_after_a_version_change_a_stored_charge_gets_410_and_nothing_runs_again(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    first = charge(api_client, key)
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")
    before = Charge.objects.count()

    after = charge(api_client, key)
    again = charge(api_client, key)

    assert first.status_code == 201
    for answer in (after, again):
        assert answer.status_code == 410 and not replayed(answer)
        assert problem(answer)["type"] == "urn:django-idempotency:response-version-changed"
        assert "Look the resource up" in problem(answer)["detail"]
    assert Charge.objects.count() == before
    # Back on the first version (a rollback of the deploy): the stored charge replays.
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2026-11")
    back = charge(api_client, key)
    assert replayed(back) and back.content == first.content


def test_a_view_that_opts_in_runs_a_key_of_another_version_anew(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    first = charge(api_client, key)
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")
    monkeypatch.setattr(ChargeCreateView, "idempotency_rerun_other_versions", True)

    after = charge(api_client, key)
    again = charge(api_client, key)

    assert after.status_code == 201 and not replayed(after)
    assert after.json()["id"] != first.json()["id"]
    assert Charge.objects.filter(pk__in=[first.json()["id"], after.json()["id"]]).count() == 2
    # The new version's response is what the key replays from now on.
    assert replayed(again) and again.content == after.content


@override_settings(IDEMPOTENCY_EXPIRED_WINDOW=timedelta(hours=1))
def test_with_the_expired_window_a_live_record_of_another_version_is_still_version_changed(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    charge(api_client, key)
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")
    before = Charge.objects.count()

    late = charge(api_client, key)

    assert late.status_code == 410
    assert problem(late)["type"].endswith("response-version-changed")
    assert Charge.objects.count() == before


@override_settings(IDEMPOTENCY_ERROR_FORMAT="stripe")
def test_the_stripe_preset_renders_a_version_change_as_its_error_object(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    charge(api_client, key)
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")

    late = charge(api_client, key)

    assert late.status_code == 410 and late["Content-Type"] == "application/json"
    error = json.loads(late.content)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "idempotency_response_version_changed"


@override_settings(IDEMPOTENCY_LOOKUP_FIRST=True)
def test_the_lookup_first_never_replays_another_version(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    charge(api_client, key)
    assert replayed(charge(api_client, key))
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")
    before = Charge.objects.count()

    after = charge(api_client, key)

    assert after.status_code == 410 and not replayed(after)
    assert Charge.objects.count() == before


@pytest.mark.urls(__name__)
def test_the_setting_versions_views_and_a_views_own_version_wins(client: Any) -> None:
    RUNS.clear()
    plain, own = new_key(), new_key()
    for path_, key in (("/unversioned/", plain), ("/versioned/", own)):
        client.post(path_, HTTP_IDEMPOTENCY_KEY=key)

    with override_settings(IDEMPOTENCY_RESPONSE_VERSION="2"):
        plain_after = client.post("/unversioned/", HTTP_IDEMPOTENCY_KEY=plain)
        own_after = client.post("/versioned/", HTTP_IDEMPOTENCY_KEY=own)
        fresh = new_key()
        client.post("/unversioned/", HTTP_IDEMPOTENCY_KEY=fresh)

    assert plain_after.status_code == 410
    assert RUNS == ["/unversioned/", "/versioned/", "/unversioned/"]
    assert replayed(own_after)
    assert IdempotencyRecord.objects.get(key=fresh).response_version == "2"
    # Unset again: a record of version "2" is of another version than none.
    assert client.post("/unversioned/", HTTP_IDEMPOTENCY_KEY=fresh).status_code == 410
    assert len(RUNS) == 3


def test_a_key_of_another_endpoint_and_version_is_a_reused_key_never_a_stale_one(
    api_client: Any,
) -> None:
    # The charges view is versioned, the refunds view is not: the charge's record is of
    # "another version" for the refunds view, yet the key stays bound to its first request.
    key = new_key()
    charge(api_client, key)
    refunds = IdempotencyRecord.objects.count()

    other = api_client.post("/api/refunds/", CHARGE, format="json", HTTP_IDEMPOTENCY_KEY=key)

    assert other.status_code == 422 and problem(other)["differing"] == ["path"]
    assert IdempotencyRecord.objects.count() == refunds


def test_after_a_version_change_another_body_on_the_key_is_still_a_reused_key(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    charge(api_client, key)
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")

    other = api_client.post(
        "/api/charges/", {**CHARGE, "amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )

    assert other.status_code == 422 and problem(other)["differing"] == ["body"]


# ---------------------------------------------------------------------------------------
# A rolling deploy: servers of several IDEMPOTENCY_RESPONSE_VERSION values on one database,
# each request of a key to one of them; the refunds view declares no version of its own.

REFUNDS, REFUND_COUNT = "/api/refunds/", "/api/refunds/count/"
REFUND = {"amount": 700, "currency": "inr"}


@pytest.fixture(scope="module")
def deploy(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
) -> Iterator[dict[str, str]]:
    """Base URLs of three servers on the test database: "none" (no version), "v1", "v2"."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for name in ("none", "v1", "v2"):
            env = {"IDEMPOTENCY_RESPONSE_VERSION": "" if name == "none" else name}
            server = stack.enter_context(gunicorn_server(workers=1, threads=2, env=env))
            urls[name] = server.url
        yield urls


def refund(url: str, user: TokenUser, key: str, **faults: Any) -> requests.Response:
    return post(url, user, key, {**REFUND, **faults}, REFUNDS)


@pytest.mark.parametrize(
    "order", [("v1", "v2", "v2", "v1"), ("none", "v1", "v1"), ("v2", "v1", "none", "v2")]
)
def test_one_key_across_servers_of_several_versions_refunds_once(
    deploy: dict[str, str], live_user: TokenUser, order: tuple[str, ...]
) -> None:
    key = new_key()
    before = counts(deploy["v1"], REFUND_COUNT)

    answers = [refund(deploy[version], live_user, key) for version in order]

    first = order[0]
    assert answers[0].status_code == 201
    for version, answer in zip(order[1:], answers[1:], strict=True):
        if version == first:
            assert replayed(answer) and answer.content == answers[0].content
        else:
            assert answer.status_code == 410, answer.text
            assert answer.json()["type"].endswith("response-version-changed")
    assert counts(deploy["v1"], REFUND_COUNT) - before == (1, 1)


def test_a_duplicate_in_flight_on_v1_and_its_retry_on_v2_refund_once(
    deploy: dict[str, str], live_user: TokenUser
) -> None:
    key = new_key()
    before = counts(deploy["v1"], REFUND_COUNT)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(refund, deploy["v1"], live_user, key, delay_ms=3000)
        wait_for(
            lambda: (
                first.done() or counts(deploy["v1"], REFUND_COUNT).executions > before.executions
            )
        )
        during = refund(deploy["v2"], live_user, key, delay_ms=3000)
        done = first.result()
    after = refund(deploy["v2"], live_user, key, delay_ms=3000)

    assert done.status_code == 201
    # Waiting is off: in progress, retry later (or, on a machine slow enough that the first
    # finished meanwhile, the version change); never run.
    assert during.status_code in (409, 410), during.text
    assert after.status_code == 410 and after.json()["type"].endswith("response-version-changed")
    assert counts(deploy["v1"], REFUND_COUNT) - before == (1, 1)
