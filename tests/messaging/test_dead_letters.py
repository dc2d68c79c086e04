"""Dead letters: a message that failed to publish IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS times (its own
fault) stops being tried, keeps its last error, is never dropped, is counted and warned about,
and is requeued by the admin or ``manage.py idempotency_outbox requeue`` under the same id."""

from __future__ import annotations

import io
import logging
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test import override_settings
from django.urls import reverse

from django_idempotency.checks import check_outbox_backlog
from django_idempotency.messaging import outbox
from django_idempotency.messaging.outbox import enqueue_task, leases
from django_idempotency.models import OutboxMessage
from django_idempotency.partitions import apply

pytestmark = pytest.mark.django_db(transaction=True)
CHANGELIST = reverse("admin:django_idempotency_outboxmessage_changelist")


def fail_once(*, hold: bool = True) -> bool:
    batch = leases.claim("default", owner="relay", limit=10)
    (message,) = batch.messages
    return leases.fail("default", batch, message, "Refused: no", owner="relay", hold=hold)


def make_dead(tries: int = 3) -> str:
    with transaction.atomic():
        message_id = enqueue_task("tests.noop")
    with override_settings(IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=tries):
        for n in range(tries):
            OutboxMessage.objects.update(lease_until=None)  # its backoff, passed
            assert fail_once() is (n == tries - 1)
    return message_id


def test_a_message_that_failed_its_last_try_is_a_dead_letter_and_is_not_claimed_again() -> None:
    message_id = make_dead()
    row = OutboxMessage.objects.get()
    assert str(row.id) == message_id and row.dead_at is not None and row.published_at is None
    assert (row.attempts, row.last_error) == (3, "Refused: no")
    OutboxMessage.objects.update(lease_until=None)
    assert leases.claim("default", owner="relay", limit=10).messages == ()
    # Counted apart from the backlog, which it no longer ages.
    assert leases.dead_letters("default", 100) == 1 and leases.oldest_pending("default") is None


def test_a_destination_out_of_reach_never_makes_a_dead_letter() -> None:
    with transaction.atomic():
        enqueue_task("tests.noop")
    with override_settings(IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=2):
        for _ in range(4):
            assert fail_once(hold=False) is False
    row = OutboxMessage.objects.get()
    assert row.dead_at is None and row.attempts == 4


def test_the_relay_logs_a_new_dead_letter_and_the_check_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django_idempotency.messaging.relay.loop import Relay

    with transaction.atomic():
        message_id = enqueue_task("tests.noop")
    relay = Relay.__new__(Relay)  # no destination needed to record a failure
    relay.using, relay.owner = "default", "relay"
    batch = leases.claim("default", owner="relay", limit=10)
    with (
        override_settings(IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=1),
        caplog.at_level(logging.ERROR, "django_idempotency"),
    ):
        relay.fail(batch, batch.messages[0], "Refused: no")
    assert f"{message_id} (tests.noop) failed to publish 1 times" in caplog.text
    (warning,) = check_outbox_backlog(None, databases=["default"])
    assert warning.id == "django_idempotency.W121" and "1 dead letters" in warning.msg


def test_the_command_counts_and_requeues_dead_letters_under_the_same_id() -> None:
    first, second = make_dead(), make_dead()
    out = io.StringIO()
    call_command("idempotency_outbox", "dead", stdout=out)
    assert out.getvalue().strip() == "2 dead letters."
    call_command("idempotency_outbox", "requeue", "--id", first, stdout=out)
    requeued = OutboxMessage.objects.get(id=first)
    assert requeued.dead_at is None and requeued.attempts == 0 and requeued.lease_until is None
    assert [str(m.id) for m in leases.claim("default", owner="r", limit=10).messages] == [first]
    with pytest.raises(CommandError, match="not dead letters"):
        call_command("idempotency_outbox", "requeue", "--id", first, stdout=out)
    call_command("idempotency_outbox", "requeue", "--all-dead", stdout=out)
    assert "Requeued 1 dead letters." in out.getvalue()
    assert OutboxMessage.objects.get(id=second).dead_at is None


def test_the_admin_filters_counts_and_requeues_dead_letters(client: object) -> None:
    dead = make_dead()
    with transaction.atomic():
        alive = enqueue_task("tests.noop")
    client.force_login(User.objects.create_superuser("admin", "a@example.com", "x"))  # type: ignore[attr-defined]
    page = client.get(CHANGELIST, {"state": "dead"})  # type: ignore[attr-defined]
    assert page.status_code == 200 and "Dead letter (1)" in page.content.decode()
    assert [str(r.id) for r in page.context["cl"].result_list] == [dead]
    done = client.post(  # type: ignore[attr-defined]
        CHANGELIST, {"action": "requeue", "_selected_action": [dead, alive]}, follow=True
    )
    assert "Requeued 1 dead letter; it is" in done.content.decode()
    assert OutboxMessage.objects.filter(dead_at__isnull=False).count() == 0


def test_a_partition_holding_a_dead_letter_is_never_dropped() -> None:
    """Guard: outbox.keep_partition counts every unpublished row, dead letters included."""
    old_day = datetime.now(UTC).date() - timedelta(days=1)
    partition = f"{outbox.TABLE}_p{old_day:%Y%m%d}"
    apply.create_partition(connection, outbox.OUTBOX, old_day, retry_for=timedelta(seconds=5))
    make_dead()
    with connection.cursor() as cursor:
        # Noon of that day, whenever it was written (midnight UTC may have passed since).
        cursor.execute(
            f"UPDATE {outbox.TABLE} SET created_at = %s",
            [datetime(old_day.year, old_day.month, old_day.day, 12, tzinfo=UTC)],
        )
    assert outbox.keep_partition(connection, partition) == "holds 1 unpublished message"
