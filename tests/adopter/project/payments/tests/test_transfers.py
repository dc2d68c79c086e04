import pytest
from django.test import Client

from django_idempotency.testing import (
    assert_executes_once,
    assert_replays,
    assert_reused_key_refused,
)
from payments.models import Transfer


@pytest.mark.django_db
def test_a_transfer_is_replayed(partner):
    assert_replays(Client(), "/transfers/", {"amount": 700}, headers={"X-Api-Key": partner.key})
    assert Transfer.objects.count() == 1


@pytest.mark.django_db
def test_a_reused_transfer_key_is_refused(partner):
    assert_reused_key_refused(
        Client(), "/transfers/", {"amount": 700}, {"amount": 1}, headers={"X-Api-Key": partner.key}
    )


@pytest.mark.django_db
def test_without_an_api_key_nothing_runs():
    response = Client().post(
        "/transfers/",
        {"amount": 700},
        content_type="application/json",
        headers={"Idempotency-Key": "k-1"},
    )
    assert response.status_code == 401
    assert Transfer.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_parallel_transfers_execute_once(partner):
    assert_executes_once(
        Client,
        "/transfers/",
        {"amount": 700},
        effects=Transfer.objects.count,
        headers={"X-Api-Key": partner.key},
    )
