"""The outbox rows' SQL (``messaging.leases``): claim under a fence and a lease, mark, fail,
release, the oldest pending message. The relay's tests cover the same against a broker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, transaction
from django.utils import timezone

from django_idempotency.messaging.outbox import TABLE, enqueue_event, enqueue_task, leases
from django_idempotency.models import OutboxMessage

pytestmark = pytest.mark.django_db(transaction=True)

USING = DEFAULT_DB_ALIAS
NEVER = timedelta(0)


def enqueue(count: int) -> list[str]:
    with transaction.atomic():
        return [enqueue_task("tests.leases.noop", (n,)) for n in range(count)]


def expire_leases() -> None:
    OutboxMessage.objects.update(lease_until=timezone.now() - timedelta(seconds=1))


def test_a_claim_leases_the_oldest_rows_to_its_owner_under_one_new_fence() -> None:
    ids = enqueue(3)
    batch = leases.claim(USING, owner="a", limit=2)
    assert [m.id for m in batch.messages] == ids[:2]
    assert [m.args for m in batch.messages] == [[0], [1]]
    rows = OutboxMessage.objects.filter(pk__in=ids[:2])
    assert {(r.lease_owner, r.fence) for r in rows} == {("a", batch.fence)}
    # To the microsecond: mark and release find the batch's rows by its span.
    written = {str(r.pk): r.created_at for r in rows}
    assert {m.id: m.created_at for m in batch.messages} == written
    assert [m.id for m in leases.claim(USING, owner="b", limit=5).messages] == ids[2:]
    assert leases.claim(USING, owner="c", limit=5).messages == ()  # all leased


def test_a_claimed_message_carries_every_field_as_written() -> None:
    # The claim sends its batch as one JSON document: nothing may change on the way.
    args = ["naïve ☃", 2**63, 0.1, None, [{"deep": [True, False]}]]
    kwargs = {"amount": 2499, "note": 'quote " and \\ and \n', "empty": {}}
    payload = {"order": "o-1", "lines": [1.5, -0.0, "€"], "nothing": None}
    with transaction.atomic():
        task = enqueue_task("tests.leases.noop", args, kwargs, countdown=2.5, ordering_key="k")
        event = enqueue_event("orders.created", payload)
    rows = {str(r.pk): r for r in OutboxMessage.objects.all()}
    batch = leases.claim(USING, owner="a", limit=5)
    assert [m.id for m in batch.messages] == [task, event]
    for message in batch.messages:
        row = rows[message.id]
        written = (row.created_at, row.kind, row.name, row.args, row.kwargs, row.payload)
        claimed = message[1:7]
        assert claimed == written
        assert (message.options, message.redrives) == (row.options, 0)
        assert message.ordering_key == row.ordering_key
    assert batch.messages[0].args == args and batch.messages[0].kwargs == kwargs
    assert batch.messages[1].payload == payload and batch.messages[0].ordering_key == "k"


def test_mark_marks_the_owners_rows_and_sets_a_check_time_only_where_asked() -> None:
    checked, unchecked = enqueue(2)
    batch = leases.claim(USING, owner="a", limit=5)
    marked = leases.mark(
        USING, batch, batch.messages, owner="a", check=[checked], after=timedelta(minutes=10)
    )
    assert marked == 2
    rows = {str(r.pk): r for r in OutboxMessage.objects.all()}
    assert all(r.published_at is not None and r.lease_until is None for r in rows.values())
    assert rows[unchecked].redrive_at is None
    wait = rows[checked].redrive_at - rows[checked].published_at
    assert wait == timedelta(minutes=10)


def test_mark_with_a_stale_fence_or_another_owner_or_a_lapsed_lease_marks_nothing() -> None:
    enqueue(2)
    stale = leases.claim(USING, owner="a", limit=5)
    expire_leases()
    fresh = leases.claim(USING, owner="a", limit=5)  # the same owner, a new fence
    assert fresh.fence > stale.fence
    assert leases.mark(USING, stale, stale.messages, owner="a", check=[], after=NEVER) == 0
    assert leases.mark(USING, fresh, fresh.messages, owner="b", check=[], after=NEVER) == 0
    expire_leases()
    assert leases.mark(USING, fresh, fresh.messages, owner="a", check=[], after=NEVER) == 0
    assert OutboxMessage.objects.filter(published_at__isnull=True).count() == 2


def test_a_held_failure_counts_the_attempt_and_backs_off_doubling() -> None:
    enqueue(1)
    for attempts, seconds in [(1, 1), (2, 2), (3, 4)]:
        expire_leases()
        batch = leases.claim(USING, owner="a", limit=1)
        before = timezone.now()
        leases.fail(USING, batch, batch.messages[0], "E" * 3000, owner="a", hold=True)
        after = timezone.now()
        row = OutboxMessage.objects.get()
        assert (row.attempts, row.lease_owner, len(row.last_error)) == (attempts, "", 2000)
        # From the FAIL statement's now(), which falls between the two readings.
        held = timedelta(seconds=seconds)
        assert before + held <= row.lease_until <= after + held


def test_a_failure_not_held_gives_the_row_back_at_once() -> None:
    enqueue(1)
    batch = leases.claim(USING, owner="a", limit=1)
    leases.fail(USING, batch, batch.messages[0], "broker down", owner="a", hold=False)
    row = OutboxMessage.objects.get()
    assert (row.attempts, row.lease_until, row.last_error) == (1, None, "broker down")
    assert len(leases.claim(USING, owner="b", limit=1).messages) == 1


def test_release_gives_back_only_the_rows_of_its_own_fence_untried() -> None:
    enqueue(2)
    stale = leases.claim(USING, owner="a", limit=5)
    expire_leases()
    fresh = leases.claim(USING, owner="a", limit=1)
    leases.release(USING, stale, stale.messages, owner="a")  # a stale fence: nothing
    assert OutboxMessage.objects.filter(lease_owner="a", fence=fresh.fence).count() == 1
    leases.release(USING, fresh, fresh.messages, owner="a")
    row = OutboxMessage.objects.get(pk=fresh.messages[0].id)
    assert (row.lease_owner, row.lease_until, row.attempts) == ("", None, 0)


def test_oldest_pending_is_when_the_oldest_unpublished_message_was_written() -> None:
    assert leases.oldest_pending(USING) is None
    published, pending = enqueue(2)
    batch = leases.claim(USING, owner="a", limit=1)
    assert leases.mark(USING, batch, batch.messages, owner="a", check=[], after=NEVER) == 1
    assert OutboxMessage.objects.get(pk=published).published_at is not None
    assert leases.oldest_pending(USING) == OutboxMessage.objects.get(pk=pending).created_at


def published(count: int) -> list[str]:
    """``count`` rows published, each due a redrive check at once."""
    ids = enqueue(count)
    batch = leases.claim(USING, owner="a", limit=count)
    leases.mark(USING, batch, batch.messages, owner="a", check=ids, after=NEVER)
    return ids


def test_due_for_check_takes_the_rows_whose_check_has_come_oldest_check_first() -> None:
    later, earlier, not_yet = published(3)
    now = timezone.now()
    OutboxMessage.objects.filter(pk=later).update(redrive_at=now - timedelta(seconds=1))
    OutboxMessage.objects.filter(pk=earlier).update(redrive_at=now - timedelta(seconds=2))
    OutboxMessage.objects.filter(pk=not_yet).update(redrive_at=now + timedelta(minutes=1))
    with transaction.atomic():
        due = leases.due_for_check(USING, 5)
        assert [str(row.pk) for row in due] == [earlier, later]
        assert [str(row.pk) for row in leases.due_for_check(USING, 1)] == [earlier]


def test_checked_rows_are_due_no_more_and_a_reason_goes_in_their_last_error() -> None:
    done, given_up = published(2)
    leases.checked(USING, [done])
    leases.checked(USING, [given_up], error="given up")
    rows = {str(r.pk): r for r in OutboxMessage.objects.all()}
    assert [rows[done].redrive_at, rows[given_up].redrive_at] == [None, None]
    assert [rows[done].last_error, rows[given_up].last_error] == ["", "given up"]
    assert all(r.published_at is not None for r in rows.values())


def test_a_row_published_again_is_pending_under_its_id_with_one_redrive_more() -> None:
    (message_id,) = published(1)
    leases.publish_again(USING, [message_id], error="lost")
    row = OutboxMessage.objects.get()
    assert (row.published_at, row.redrive_at, row.lease_owner, row.lease_until) == (
        None, None, "", None,
    )  # fmt: skip
    assert (row.redrives, row.last_error) == (1, "lost")
    again = leases.claim(USING, owner="b", limit=1)
    assert [(m.id, m.redrives) for m in again.messages] == [(message_id, 1)]


def test_a_claim_finds_its_rows_by_the_primary_key_not_by_reading_the_partition() -> None:
    # Published rows stay until their partition is dropped: a claim that read them all (a
    # hash of the partition, as the planner chose for a join on the batch alone) costs more
    # with every message of the day.
    with transaction.atomic():
        for start in range(0, 3000, 500):
            for n in range(start, start + 500):
                enqueue_task("tests.leases.noop", (n,))
    OutboxMessage.objects.update(published_at=timezone.now())
    enqueue(600)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}")
        cursor.execute(f"SELECT DISTINCT tableoid::regclass::text FROM {TABLE}")
        holding = {row[0] for row in cursor.fetchall()}  # two, if written across midnight
        cursor.execute("EXPLAIN (FORMAT JSON) " + leases.CLAIM, [500, "a", "60 seconds"])
        plan = cursor.fetchone()[0]
    root = (plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]
    updated = next(n for n in plan_nodes(root) if n.get("Operation") == "Update")
    # The rows' partitions; empty ones are read as they are, which costs nothing.
    scans = [n["Node Type"] for n in plan_nodes(updated) if n.get("Relation Name") in holding]
    assert scans and "Seq Scan" not in scans, scans


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from plan_nodes(child)


def test_a_claim_and_a_mark_commit_without_waiting_for_the_flush_in_their_own_transaction() -> None:
    # Lost, they only publish rows again under the same ids; the session (a pooled server
    # connection under PgBouncer, say) keeps the server's setting for everything else.
    enqueue(2)

    def setting() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('synchronous_commit')")
            return str(cursor.fetchone()[0])

    server = setting()
    with transaction.atomic():
        batch = leases.claim(USING, owner="a", limit=5)
        assert setting() == "off"
    assert setting() == server
    with transaction.atomic():
        assert leases.mark(USING, batch, batch.messages, owner="a", check=[], after=NEVER) == 2
        assert setting() == "off"
    assert setting() == server
