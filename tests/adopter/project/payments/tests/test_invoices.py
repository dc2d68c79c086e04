import pytest
from rest_framework.test import APIClient

from django_idempotency.testing import (
    assert_crash_after_write_leaves_key_free,
    assert_executes_once,
    assert_replays,
    assert_reused_key_refused,
)
from payments.models import Event, Invoice

INVOICE = {"amount": 2499, "currency": "inr"}


@pytest.mark.django_db
def test_a_retry_is_replayed(api):
    assert_replays(api, "/api/invoices/", INVOICE)
    assert Invoice.objects.count() == 1


@pytest.mark.django_db
def test_a_reused_key_is_refused(api):
    assert_reused_key_refused(api, "/api/invoices/", INVOICE, {**INVOICE, "amount": 1})


@pytest.mark.django_db
def test_a_crash_after_the_write_leaves_the_key_free(api):
    assert_crash_after_write_leaves_key_free(
        api, "/api/invoices/", INVOICE, effects=Invoice.objects.count
    )


@pytest.mark.django_db
def test_paying_is_replayed(api, alice):
    invoice = Invoice.objects.create(owner=alice, **INVOICE)
    assert_replays(api, f"/api/invoices/{invoice.pk}/pay/", {})
    assert Event.objects.filter(kind="invoice.paid").count() == 1


@pytest.mark.django_db
def test_a_patch_is_replayed(api, alice):
    invoice = Invoice.objects.create(owner=alice, **INVOICE)
    assert_replays(api, f"/api/invoices/{invoice.pk}/", {"amount": 5}, method="PATCH")
    assert Event.objects.filter(kind="invoice.patched").count() == 1


@pytest.mark.django_db(transaction=True)
def test_parallel_duplicates_execute_once(alice):
    def new_client():
        client = APIClient()
        client.force_authenticate(alice)
        return client

    assert_executes_once(new_client, "/api/invoices/", INVOICE, effects=Invoice.objects.count)
