"""Response versions (contract 8): a record stored under another version than the view's is
treated as expired, over HTTP on the payments API, the decorator and the settings."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.http import HttpRequest, JsonResponse
from django.test import override_settings
from django.urls import path

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from testproject.payments.models import Charge
from testproject.payments.views import ChargeCreateView
from tests.factories import new_key
from tests.support.client import problem, replayed

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


def test_after_a_version_change_a_stored_charge_is_never_replayed_and_the_key_runs_anew(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    first = charge(api_client, key)
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")

    after = charge(api_client, key)
    again = charge(api_client, key)

    assert after.status_code == 201 and not replayed(after)
    assert after.json()["id"] != first.json()["id"]
    assert Charge.objects.filter(pk__in=[first.json()["id"], after.json()["id"]]).count() == 2
    # The new version's response is what the key replays from now on.
    assert replayed(again) and again.content == after.content


@override_settings(IDEMPOTENCY_EXPIRED_WINDOW=timedelta(hours=1))
def test_with_the_expired_window_a_record_of_another_version_gets_410_and_nothing_runs(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    charge(api_client, key)
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")
    before = Charge.objects.count()

    late = charge(api_client, key)

    assert late.status_code == 410
    assert problem(late)["type"].endswith("key-expired")
    assert Charge.objects.count() == before


@override_settings(IDEMPOTENCY_LOOKUP_FIRST=True)
def test_the_lookup_first_never_replays_another_version(
    api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    first = charge(api_client, key)
    assert replayed(charge(api_client, key))
    monkeypatch.setattr(ChargeCreateView, "idempotency_response_version", "2027-01")

    after = charge(api_client, key)

    assert not replayed(after) and after.json()["id"] != first.json()["id"]


@pytest.mark.urls(__name__)
def test_the_setting_versions_views_and_a_views_own_version_wins(client: Any) -> None:
    RUNS.clear()
    plain, own = new_key(), new_key()
    for path_, key in (("/unversioned/", plain), ("/versioned/", own)):
        client.post(path_, HTTP_IDEMPOTENCY_KEY=key)

    with override_settings(IDEMPOTENCY_RESPONSE_VERSION="2"):
        plain_after = client.post("/unversioned/", HTTP_IDEMPOTENCY_KEY=plain)
        own_after = client.post("/versioned/", HTTP_IDEMPOTENCY_KEY=own)

    assert not replayed(plain_after) and json.loads(plain_after.content) == {"run": 3}
    assert replayed(own_after)
    assert IdempotencyRecord.objects.filter(key=plain).latest("id").response_version == "2"
    # Unset again: a record of version "2" is of another version than none.
    assert not replayed(client.post("/unversioned/", HTTP_IDEMPOTENCY_KEY=plain))


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
