"""The test helpers a project's own suite uses (``django_idempotency.testing``), against the
payments API: each passes on a protected endpoint and fails, naming why, on the same handler
unprotected (``/api/charges-plain/``)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client, TransactionTestCase
from rest_framework.test import APIClient

from django_idempotency.testing import (
    assert_crash_after_write_leaves_key_free,
    assert_executes_once,
    assert_replays,
    assert_reused_key_refused,
)
from testproject.payments.models import Charge
from tests.factories import TokenFactory

CHARGE = {"amount": 2499, "currency": "inr"}
OTHER = {"amount": 999, "currency": "inr"}
# The DRF view and the plain Django view (``@idempotent``) of the same charge handler.
PROTECTED = ["/api/charges/", "/api/charges-django/"]
UNPROTECTED = "/api/charges-plain/"


def token_client(token: str, client_class: type[Client] = APIClient) -> Client:
    return client_class(headers={"Authorization": f"Token {token}"})


@pytest.fixture
def token(db: None) -> str:
    key: str = TokenFactory().key
    return key


@pytest.mark.parametrize("path", PROTECTED)
@pytest.mark.parametrize("client_class", [APIClient, Client])
def test_assert_replays_passes_on_a_protected_endpoint(
    path: str, client_class: type[Client], token: str
) -> None:
    replayed = assert_replays(token_client(token, client_class), path, CHARGE)

    assert replayed.first.status_code == 201
    assert replayed.retry.content == replayed.first.content
    assert Charge.objects.count() == 1


def test_assert_replays_fails_on_an_unprotected_endpoint(token: str) -> None:
    with pytest.raises(AssertionError, match=r"the retry was not replayed .*is the view protected"):
        assert_replays(token_client(token), UNPROTECTED, CHARGE)


@pytest.mark.parametrize("path", PROTECTED)
def test_assert_reused_key_refused_passes_on_a_protected_endpoint(path: str, token: str) -> None:
    refused = assert_reused_key_refused(token_client(token), path, CHARGE, OTHER)

    assert refused.json()["type"].endswith("key-reused")
    assert Charge.objects.count() == 1


def test_assert_reused_key_refused_fails_on_an_unprotected_endpoint(token: str) -> None:
    with pytest.raises(AssertionError, match="a reused key got 201"):
        assert_reused_key_refused(token_client(token), UNPROTECTED, CHARGE, OTHER)


@pytest.mark.parametrize("path", PROTECTED)
def test_assert_crash_after_write_leaves_key_free_passes_on_a_protected_endpoint(
    path: str, token: str
) -> None:
    retry = assert_crash_after_write_leaves_key_free(
        token_client(token), path, CHARGE, effects=Charge.objects.count
    )

    assert retry.status_code == 201
    assert Charge.objects.count() == 1


def test_assert_crash_after_write_fails_where_nothing_is_protected(token: str) -> None:
    with pytest.raises(AssertionError, match="the crashed request was answered 201"):
        assert_crash_after_write_leaves_key_free(
            token_client(token), UNPROTECTED, CHARGE, effects=Charge.objects.count
        )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", PROTECTED)
def test_assert_executes_once_passes_over_real_connections(path: str) -> None:
    token = TokenFactory().key

    responses = assert_executes_once(
        lambda: token_client(token), path, CHARGE, effects=Charge.objects.count
    )

    assert len(responses) == 8
    assert {response.status_code for response in responses} <= {201, 409}
    assert Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_assert_executes_once_fails_on_an_unprotected_endpoint() -> None:
    token = TokenFactory().key

    with pytest.raises(AssertionError, match="8 duplicates had 8 effects, not 1"):
        assert_executes_once(
            lambda: token_client(token), UNPROTECTED, CHARGE, effects=Charge.objects.count
        )


def test_assert_executes_once_refuses_a_test_inside_a_transaction(token: str) -> None:
    with pytest.raises(AssertionError, match="needs a transactional test"):
        assert_executes_once(
            lambda: token_client(token), PROTECTED[0], CHARGE, effects=Charge.objects.count
        )


class UnittestStyle(TransactionTestCase):
    """The same helpers in a unittest suite."""

    def setUp(self) -> None:
        self.token = TokenFactory().key

    def client_(self) -> Any:
        return token_client(self.token)

    def test_every_helper_in_a_transaction_test_case(self) -> None:
        assert_replays(self.client_(), PROTECTED[0], CHARGE)
        assert_reused_key_refused(self.client_(), PROTECTED[0], CHARGE, OTHER)
        assert_crash_after_write_leaves_key_free(
            self.client_(), PROTECTED[0], CHARGE, effects=Charge.objects.count
        )
        assert_executes_once(self.client_, PROTECTED[0], CHARGE, effects=Charge.objects.count)
        self.assertEqual(Charge.objects.count(), 4)
