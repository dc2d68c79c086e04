"""The payments API's ledger posting, one function behind each way its message arrives: the
Celery task (``tests/scenarios/test_chain.py`` runs it with real workers), the NATS handler
and the task of Django's Tasks framework (the reliability suite's ``nats`` and ``tasks-rq``
chain profiles run those with real servers; here, their wiring)."""

from __future__ import annotations

import importlib.util
import uuid
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency.messaging.destinations.nats import body
from django_idempotency.messaging.outbox.leases import Message
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from testproject.payments.models import Charge, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def charge(token_user: Any) -> Charge:
    return Charge.objects.create(amount=2499, currency="inr", user=token_user.user)


def test_the_nats_handler_posts_the_task_body_the_nats_destination_publishes(
    charge: Charge,
) -> None:
    from django_idempotency.messaging.consumers.nats import StreamMessage
    from testproject.payments.handlers import post_ledger_entry

    message_id = str(uuid.uuid4())
    published = Message(
        message_id, timezone.now(), OutboxMessage.Kind.TASK, "payments.post_ledger_entry",
        [charge.pk, 2499, "inr"], {}, None, {},
    )  # fmt: skip
    with transaction.atomic():
        post_ledger_entry(
            StreamMessage(
                "payments.post_ledger_entry", body(published), {}, message_id, "LEDGER", 1, 1
            )
        )
    entry = LedgerEntry.objects.get()
    assert (entry.charge_id, entry.amount, entry.currency) == (charge.pk, 2499, "inr")
    assert entry.message_id == message_id


# Django's Tasks framework: built in from Django 6.0, else the backport (the tasks extra).
FRAMEWORK = "django.tasks" if importlib.util.find_spec("django.tasks") else "django_tasks"
IMMEDIATE = {
    "default": {"BACKEND": "django_idempotency.messaging.task_backend.OutboxBackend",
                "OPTIONS": {"backend": "immediate"}},
    "immediate": {"BACKEND": f"{FRAMEWORK}.backends.immediate.ImmediateBackend"},
}  # fmt: skip
TASKS_DESTINATIONS = {
    "default": {"BACKEND": "django_idempotency.messaging.destinations.celery.CeleryDestination"},
    "tasks": {"BACKEND": "django_idempotency.messaging.destinations.tasks.TasksDestination"},
}


@override_settings(
    PAYMENTS_LEDGER="tasks", TASKS=IMMEDIATE, IDEMPOTENCY_OUTBOX_DESTINATIONS=TASKS_DESTINATIONS
)
def test_with_payments_ledger_tasks_the_posting_is_a_django_task_run_once_per_message(
    charge: Charge,
) -> None:
    pytest.importorskip(FRAMEWORK)
    from django_idempotency.messaging.consumers.tasks import DELIVER
    from testproject.payments.chain import post_to_ledger

    with transaction.atomic():
        message_id = post_to_ledger(charge, "cap_1")
    row = OutboxMessage.objects.get()
    assert str(row.pk) == message_id
    assert row.name == "testproject.payments.ledger_tasks.post_ledger_entry"
    assert row.options["destination"] == "tasks" and row.args == [charge.pk, 2499, "inr"]
    # As the relay hands it to the real backend (here one that runs it at once), twice.
    for _ in range(2):
        DELIVER.using(backend="immediate").enqueue(message_id, row.name, row.args, row.kwargs)
    entry = LedgerEntry.objects.get()
    assert (entry.charge_id, entry.message_id) == (charge.pk, message_id)
    assert IdempotencyRecord.objects.filter(key=message_id).count() == 1


# After an asynchronous failover that lost a run's commit, the run's ledger message may still
# arrive while the new primary's sequence has given the run's charge id to another charge (a
# failover profile found a charge with two ledger rows and one with none). The capture, the
# same in every run of the request, names the charge instead.


def test_a_posting_names_its_charge_by_the_capture_not_by_an_id_a_failover_reused(
    charge: Charge, token_user: Any
) -> None:
    from testproject.payments import ledger
    from testproject.payments.models import Capture

    run_again = Charge.objects.create(amount=2499, currency="inr", user=token_user.user)
    Capture.objects.create(charge=run_again, capture_id="cap_1")
    with transaction.atomic():
        # The first run's message: its charge id is now another charge's.
        ledger.post_ledger_entry(str(uuid.uuid4()), charge.pk, 2499, "inr", capture="cap_1")
    assert list(LedgerEntry.objects.values_list("charge_id", flat=True)) == [run_again.pk]


def test_a_posting_whose_capture_is_not_there_fails_and_writes_nothing(charge: Charge) -> None:
    from testproject.payments import ledger
    from testproject.payments.models import Capture

    with pytest.raises(Capture.DoesNotExist), transaction.atomic():
        ledger.post_ledger_entry(str(uuid.uuid4()), charge.pk, 2499, "inr", capture="cap_lost")
    assert LedgerEntry.objects.count() == 0


def test_the_charges_ledger_message_names_its_capture(charge: Charge) -> None:
    from testproject.payments import chain

    with transaction.atomic():
        chain.post_to_ledger(charge, "cap_2")
    (message,) = OutboxMessage.objects.all()
    assert message.args == [charge.pk, 2499, "inr"]
    assert message.kwargs == {"capture": "cap_2"}
