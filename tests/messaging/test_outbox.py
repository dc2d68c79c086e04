"""The outbox API: a row in the caller's transaction, or an error; never a row on its own."""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from django_idempotency.engine.unit import UnitOfWork
from django_idempotency.engine.work import Result, Run, Work
from django_idempotency.messaging import outbox
from django_idempotency.messaging.outbox import (
    NotInTransaction,
    OutboxError,
    enqueue_event,
    enqueue_task,
    new_message_id,
)
from django_idempotency.models import OutboxMessage
from django_idempotency.partitions import apply
from django_idempotency.storage import records


def test_message_ids_are_uuid7_growing_and_carry_their_time() -> None:
    before = datetime.now(UTC) - timedelta(milliseconds=1)
    made = [new_message_id() for _ in range(5000)]
    after = datetime.now(UTC) + timedelta(milliseconds=1)
    ids = [message_id for message_id, _ in made]
    assert all(message_id.version == 7 for message_id in ids)
    assert all(message_id.variant == uuid.RFC_4122 for message_id in ids)
    assert ids == sorted(ids, key=lambda u: u.int) and len(set(ids)) == len(ids)
    for message_id, created_at in made:
        assert before <= created_at <= after
        assert message_id.int >> 80 == int(created_at.timestamp() * 1000)


@pytest.mark.django_db(transaction=True)
def test_enqueue_outside_a_transaction_is_refused_and_writes_nothing() -> None:
    with pytest.raises(NotInTransaction, match=r"transaction\.atomic"):
        enqueue_task("tests.noop")
    with pytest.raises(NotInTransaction):
        enqueue_event("charge.created", {"id": 1})
    assert not OutboxMessage.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_committed_task_call_is_one_pending_row_with_its_arguments() -> None:
    with transaction.atomic():
        message_id = enqueue_task(
            "payments.post_ledger_entry", (1, "inr"), {"amount": 2499}, queue="ledger", countdown=5
        )
    row = OutboxMessage.objects.get()
    assert str(row.id) == message_id and uuid.UUID(message_id).version == 7
    assert row.kind == OutboxMessage.Kind.TASK and row.name == "payments.post_ledger_entry"
    assert (row.args, row.kwargs, row.payload) == ([1, "inr"], {"amount": 2499}, None)
    assert row.options == {"queue": "ledger", "countdown": 5.0}
    assert row.published_at is None and row.attempts == 0 and row.fence == 0
    assert row.created_at == new_message_id_time(message_id)


def new_message_id_time(message_id: str) -> datetime:
    return datetime.fromtimestamp((uuid.UUID(message_id).int >> 80) / 1000, UTC)


@pytest.mark.django_db(transaction=True)
def test_a_task_object_is_enqueued_by_its_name() -> None:
    class Task:
        name = "payments.tasks.send_receipt"

    with transaction.atomic():
        enqueue_task(Task())
    assert OutboxMessage.objects.get().name == "payments.tasks.send_receipt"


@pytest.mark.django_db(transaction=True)
def test_an_event_is_a_row_with_its_topic_and_payload() -> None:
    with transaction.atomic():
        message_id = enqueue_event("charge.settled", {"charge": 7, "amount": "24.99"})
    row = OutboxMessage.objects.get(id=message_id)
    assert row.kind == OutboxMessage.Kind.EVENT
    assert (row.name, row.payload, row.args, row.kwargs) == (
        "charge.settled",
        {"charge": 7, "amount": "24.99"},
        [],
        {},
    )


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_leaves_no_row() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        enqueue_task("tests.noop")
        enqueue_event("x", {})
        raise Boom
    assert not OutboxMessage.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_savepoint_takes_its_message_with_it() -> None:
    with transaction.atomic():
        kept = enqueue_task("tests.kept")
        try:
            with transaction.atomic():
                enqueue_task("tests.dropped")
                raise ValueError
        except ValueError:
            pass
    assert [str(pk) for pk in OutboxMessage.objects.values_list("id", flat=True)] == [kept]


@pytest.mark.django_db(transaction=True)
def test_arguments_that_are_not_json_are_refused_in_the_request() -> None:
    with transaction.atomic():
        with pytest.raises(OutboxError, match="JSON"):
            enqueue_task("tests.noop", (object(),))
        with pytest.raises(OutboxError, match="JSON"):
            enqueue_event("x", {"amount": float("nan")})
    assert not OutboxMessage.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_insert_notifies_the_relay_channel_on_commit_only() -> None:
    listener = connection.get_new_connection(connection.get_connection_params())
    listener.autocommit = True
    try:
        listener.execute(f"LISTEN {outbox.CHANNEL}")
        with transaction.atomic():
            enqueue_task("tests.noop")
            assert list(listener.notifies(timeout=0.2)) == []  # not before the commit
        (note,) = list(listener.notifies(timeout=2, stop_after=1))
        assert note.channel == outbox.CHANNEL
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_the_table_is_partitioned_by_created_at_with_first_partitions_marked_ours() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_partkeydef(%s::regclass), "
            "(SELECT array_agg(a.attname ORDER BY a.attname) FROM pg_index i "
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            " WHERE i.indrelid = %s::regclass AND i.indisprimary)",
            [outbox.TABLE, outbox.TABLE],
        )
        assert cursor.fetchone() == ("RANGE (created_at)", ["created_at", "id"])
        cursor.execute(
            "SELECT c.relname, obj_description(c.oid, 'pg_class') FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass "
            "ORDER BY 1",
            [outbox.TABLE],
        )
        found = cursor.fetchall()
        cursor.execute("SELECT pg_get_indexdef(%s::regclass)", ["idempotency_outbox_pending"])
        (index,) = cursor.fetchone()
    today = datetime.now(UTC).date()
    # The migration's first partitions: today and a week ahead (maintenance runs of other
    # tests may have added later days, or dropped yesterday's), every one marked ours. The
    # migration ran when the session began: today, or yesterday once midnight UTC passed.
    assert any(
        {f"{outbox.TABLE}_p{day + timedelta(days=n):%Y%m%d}" for n in range(8)}
        <= {name for name, _ in found}
        for day in (today, today - timedelta(days=1))
    ), found
    assert {comment for _, comment in found} == {"django_idempotency:auto"}
    assert index.endswith("(created_at) WHERE (published_at IS NULL)")


# The admin ----------------------------------------------------------------------------

OUTBOX_CHANGELIST = "/admin/django_idempotency/outboxmessage/"


@pytest.fixture
def superuser_client(client):
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_superuser("admin", "admin@example.com", "x"))
    return client


def listed_ids(response) -> list[str]:
    return [str(message.id) for message in response.context["cl"].result_list]


@pytest.mark.django_db(transaction=True)
def test_admin_lists_messages_newest_first_without_counting_the_table(superuser_client) -> None:
    from django.test.utils import CaptureQueriesContext

    with transaction.atomic():
        ids = [enqueue_task("tests.noop", (n,)) for n in range(5)]
    with CaptureQueriesContext(connection) as queries:
        response = superuser_client.get(OUTBOX_CHANGELIST)
    assert response.status_code == 200
    assert listed_ids(response) == ids[::-1]
    statements = [q["sql"] for q in queries.captured_queries if "outbox" in q["sql"]]
    assert not [sql for sql in statements if "COUNT(*)" in sql and "LIMIT" not in sql]
    # The list never loads arguments or payloads.
    assert not [sql for sql in statements if '"args"' in sql and "LIMIT 50" in sql]


@pytest.mark.django_db(transaction=True)
def test_admin_filters_pending_failing_published_and_checking(superuser_client) -> None:
    with transaction.atomic():
        checked, published, failing, pending = (enqueue_task("tests.noop") for _ in range(4))
    now = datetime.now(UTC)
    OutboxMessage.objects.filter(id__in=[published, checked]).update(published_at=now)
    OutboxMessage.objects.filter(id=checked).update(redrive_at=now + timedelta(minutes=10))
    OutboxMessage.objects.filter(id=failing).update(attempts=2, last_error="ConnectionError")
    for state, expected in [
        ("published", [published, checked]),
        ("pending", [pending, failing]),
        ("failing", [failing]),
        ("checking", [checked]),
    ]:
        response = superuser_client.get(OUTBOX_CHANGELIST, {"state": state})
        assert listed_ids(response) == expected, state
    assert superuser_client.get(OUTBOX_CHANGELIST, {"state": "nope"}).status_code in (200, 302)


@pytest.mark.django_db(transaction=True)
def test_admin_search_finds_the_exact_message_id_only(superuser_client) -> None:
    with transaction.atomic():
        wanted, _other = enqueue_task("tests.noop"), enqueue_task("tests.noop")
    assert listed_ids(superuser_client.get(OUTBOX_CHANGELIST, {"q": f" {wanted} "})) == [wanted]
    assert listed_ids(superuser_client.get(OUTBOX_CHANGELIST, {"q": "tests.noop"})) == []


@pytest.mark.django_db(transaction=True)
def test_admin_is_read_only_and_shows_the_last_error(superuser_client) -> None:
    with transaction.atomic():
        message_id = enqueue_task("tests.noop", ("secret-free",))
    OutboxMessage.objects.filter(id=message_id).update(attempts=1, last_error="Boom: broker gone")
    detail = f"{OUTBOX_CHANGELIST}{message_id}/change/"
    response = superuser_client.get(detail)
    assert response.status_code == 200 and b"Boom: broker gone" in response.content
    assert superuser_client.get(f"{OUTBOX_CHANGELIST}add/").status_code == 403
    assert superuser_client.post(f"{OUTBOX_CHANGELIST}{message_id}/delete/").status_code == 403
    assert superuser_client.post(detail, {"name": "changed"}).status_code == 403
    assert OutboxMessage.objects.get(id=message_id).name == "tests.noop"


@pytest.mark.django_db(transaction=True)
def test_admin_says_when_the_consumers_record_will_be_checked(superuser_client) -> None:
    with transaction.atomic():
        message_id = enqueue_task("tests.noop")
    due = timezone.now() + timedelta(minutes=10)
    OutboxMessage.objects.filter(id=message_id).update(published_at=timezone.now(), redrive_at=due)

    page = superuser_client.get(f"{OUTBOX_CHANGELIST}{message_id}/change/").content.decode()

    assert "Consumer&#x27;s record to be checked at" in page
    assert "checked at:" not in page.replace("to be checked at", "")


@pytest.mark.django_db(transaction=True)
def test_a_partition_holding_an_unpublished_message_is_never_dropped_however_old() -> None:
    old_day = datetime.now(UTC).date() - timedelta(days=1)
    partition = f"{outbox.TABLE}_p{old_day:%Y%m%d}"
    # Another test's maintenance run may have dropped it: yesterday's rows need it.
    apply.create_partition(connection, outbox.OUTBOX, old_day, retry_for=timedelta(seconds=5))
    assert outbox.keep_partition(connection, partition) is None  # empty: may go
    with transaction.atomic():
        ids = [enqueue_task("tests.noop") for _ in range(3)]
    with connection.cursor() as cursor:
        # Yesterday's rows, as if written then (at noon of the day named above, whenever
        # they were written: midnight UTC may have passed since).
        cursor.execute(
            f"UPDATE {outbox.TABLE} SET created_at = %s",
            [datetime(old_day.year, old_day.month, old_day.day, 12, tzinfo=UTC)],
        )
    assert outbox.keep_partition(connection, partition) == "holds 3 unpublished messages"
    OutboxMessage.objects.filter(id__in=ids[:2]).update(published_at=datetime.now(UTC))
    assert outbox.keep_partition(connection, partition) == "holds 1 unpublished message"
    OutboxMessage.objects.filter(id=ids[2]).update(published_at=datetime.now(UTC))
    assert outbox.keep_partition(connection, partition) is None  # all published: may go


@pytest.mark.django_db(transaction=True)
def test_published_messages_are_kept_for_the_outbox_retention_then_their_day_may_go():
    from django.test import override_settings

    from django_idempotency.partitions.maintain import maintain

    with transaction.atomic():
        published = enqueue_task("tests.noop")
    OutboxMessage.objects.filter(id=published).update(published_at=datetime.now(UTC))
    today = datetime.now(UTC).date()
    name = outbox.OUTBOX.partition_name(today)
    two_days_on = datetime(today.year, today.month, today.day, 12, tzinfo=UTC) + timedelta(days=2)

    def dropped(retention: timedelta) -> list[str]:
        with override_settings(IDEMPOTENCY_OUTBOX_RETENTION=retention):
            report = maintain(now=two_days_on, tables=[outbox.OUTBOX], drop=True, dry_run=True)
        return [partition.name for partition in report.plan.tables[0].drop]

    # Contract 12: published rows stay for audit as long as configured, whatever else holds.
    assert name not in dropped(timedelta(days=7))
    assert name in dropped(timedelta(hours=1))


@pytest.mark.parametrize(
    ("setting", "value", "check_id"),
    [
        ("IDEMPOTENCY_OUTBOX_LEASE", 60, "django_idempotency.E013"),
        ("IDEMPOTENCY_OUTBOX_POLL_INTERVAL", timedelta(0), "django_idempotency.E003"),
        ("IDEMPOTENCY_OUTBOX_RETENTION", timedelta(-1), "django_idempotency.E003"),
        ("IDEMPOTENCY_OUTBOX_MAX_AGE", "5m", "django_idempotency.E013"),
        ("IDEMPOTENCY_OUTBOX_BATCH_SIZE", 0, "django_idempotency.E008"),
    ],
)
def test_outbox_settings_out_of_range_are_refused_by_the_settings_check(
    setting: str, value: object, check_id: str
) -> None:
    from django.test import override_settings

    from django_idempotency.checks import check_settings

    with override_settings(**{setting: value}):
        found = [m for m in check_settings(None) if setting in m.msg]
    assert [m.id for m in found] == [check_id]


@pytest.mark.django_db(transaction=True)
def test_maintenance_drops_published_days_of_the_outbox_and_keeps_a_day_with_a_pending_one():
    from django.test import override_settings

    from django_idempotency.partitions.maintain import maintain
    from django_idempotency.partitions.tables import registered

    assert outbox.OUTBOX in registered()
    today = datetime.now(UTC).date()
    yesterday, tomorrow = today - timedelta(days=1), today + timedelta(days=1)
    with transaction.atomic():
        published, pending = enqueue_task("tests.noop"), enqueue_task("tests.noop")
    OutboxMessage.objects.filter(id=published).update(published_at=datetime.now(UTC))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {outbox.TABLE} SET created_at = created_at - interval '1 day' WHERE id = %s",
            [published],
        )
    # Two days on, with a one-hour retention: yesterday, today and tomorrow are past it.
    later = datetime(tomorrow.year, tomorrow.month, tomorrow.day, 12, tzinfo=UTC) + timedelta(
        days=1
    )
    name = outbox.OUTBOX.partition_name
    try:
        with override_settings(IDEMPOTENCY_OUTBOX_RETENTION=timedelta(hours=1)):
            preview = maintain(now=later, tables=[outbox.OUTBOX], dry_run=True)
            assert f"keep             {name(today)}  (holds 1 unpublished message)" in (
                "\n".join(preview.lines())
            )
            report = maintain(now=later, tables=[outbox.OUTBOX])
        assert sorted(report.dropped) == [name(yesterday), name(tomorrow)]
        assert [str(pk) for pk in OutboxMessage.objects.values_list("id", flat=True)] == [pending]
    finally:
        maintain(tables=[outbox.OUTBOX])  # today's partitions ahead again
    OutboxMessage.objects.filter(id=pending).update(published_at=datetime.now(UTC))
    with override_settings(IDEMPOTENCY_OUTBOX_RETENTION=timedelta(hours=1)):
        report = maintain(now=later, tables=[outbox.OUTBOX], drop=True, dry_run=True)
    assert name(today) in [p.name for p in report.plan.tables[0].drop]  # all published: may go


@pytest.mark.django_db(transaction=True)
def test_without_notify_the_row_is_written_and_no_relay_is_woken() -> None:
    from django.test import override_settings

    listener = connection.get_new_connection(connection.get_connection_params())
    listener.autocommit = True
    try:
        listener.execute(f"LISTEN {outbox.CHANNEL}")
        with override_settings(IDEMPOTENCY_OUTBOX_NOTIFY=False), transaction.atomic():
            message_id = enqueue_task("tests.noop")
        assert list(listener.notifies(timeout=0.3)) == []
        assert OutboxMessage.objects.filter(id=message_id).exists()
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_admin_pages_read_indexes_only_among_many_published_messages(superuser_client) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            # All in today's partition (UTC), whatever the time of day: earlier days' may not
            # exist in a database created today.
            f"INSERT INTO {outbox.TABLE} (id, created_at, kind, name, published_at) "
            "SELECT gen_random_uuid(), "
            "greatest(now() - n * interval '100 ms', date_trunc('day', now(), 'UTC')), "
            "0, 'x', now() FROM generate_series(1, 50000) AS n"
        )
        cursor.execute(f"ANALYZE {outbox.TABLE}")
    with transaction.atomic():
        pending = [enqueue_task("tests.noop") for _ in range(3)]
    plans = {}
    for state in ("pending", "failing", None):
        response = superuser_client.get(OUTBOX_CHANGELIST, {"state": state} if state else {})
        if state == "pending":
            assert listed_ids(response) == pending[::-1]
        queryset = response.context["cl"].queryset
        plans[state] = queryset[:50].explain()
    # Unpublished rows come from the partial index, the newest page from the primary key.
    assert "_created_at_idx" in plans["pending"] and "_created_at_idx" in plans["failing"]
    assert "_pkey" in plans[None]
    busy = f"{outbox.TABLE}_p{datetime.now(UTC).date():%Y%m%d}"
    for plan in plans.values():
        assert not [line for line in plan.splitlines() if f"Seq Scan on {busy} " in line]


# Inside a unit of work: the row rides with the store --------------------------------------


def _unit(key: str | None = None) -> UnitOfWork:
    work = Work(
        principal="tests:outbox",
        key=key or str(uuid.uuid4()),
        method="POST",
        path="/outbox/",
        fingerprint={},
        ttl=timedelta(hours=1),
    )
    return UnitOfWork(work, wait=timedelta(0))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("body_bytes", [2, records.BINARY_BODY_MIN_BYTES], ids=["hex", "binary"])
def test_in_a_unit_of_work_the_row_travels_with_the_store_and_its_commit(
    body_bytes: int,
) -> None:
    from bench.round_trips import libpq_trace
    from tests.support.claims import traced_stores

    unit = _unit()
    assert isinstance(unit.open(), Run)
    with connection.cursor() as cursor, libpq_trace(connection.connection.pgconn) as during:
        message_id = enqueue_task("tests.noop", (1,), {"amount": 2499})
        cursor.execute("SELECT count(*) FROM django_idempotency_outbox")
        assert cursor.fetchone() == (0,)  # not sent yet
    with traced_stores() as stores:
        assert unit.close(Result(201, [], b"x" * body_bytes)) is True
    assert during.round_trips == 1  # the count: the enqueue sent nothing
    [(trace, _)] = stores
    # The row (INSERT and NOTIFY), the store, the COMMIT.
    assert trace.round_trips == 1 and trace.statements == ["SELECT", "SELECT", "COMMIT"]
    row = OutboxMessage.objects.get()
    assert (str(row.id), row.args, row.kwargs) == (message_id, [1], {"amount": 2499})


@pytest.mark.django_db(transaction=True)
def test_a_row_written_in_a_savepoint_that_rolled_back_stays_out() -> None:
    unit = _unit()
    assert isinstance(unit.open(), Run)
    kept = enqueue_task("tests.noop", ("kept",))
    with contextlib.suppress(ZeroDivisionError), transaction.atomic():
        enqueue_task("tests.noop", ("undone",))
        1 / 0  # noqa: B018
    with transaction.atomic():
        also = enqueue_task("tests.noop", ("released",))
    unit.close(Result(201, [], b"{}"))
    assert sorted(str(pk) for pk in OutboxMessage.objects.values_list("id", flat=True)) == sorted(
        [kept, also]
    )


@pytest.mark.django_db(transaction=True)
def test_a_unit_that_fails_or_is_not_stored_writes_no_row() -> None:
    unit = _unit()
    assert isinstance(unit.open(), Run)
    enqueue_task("tests.noop")
    unit.fail(ValueError("the work raised"))
    unit = _unit()
    assert isinstance(unit.open(), Run)
    enqueue_task("tests.noop")
    assert unit.close(Result(500, [], b"{}")) is False
    assert not OutboxMessage.objects.exists()
    # And a later plain transaction is not caught by a finished unit.
    with transaction.atomic():
        enqueue_task("tests.noop")
        assert OutboxMessage.objects.count() == 1  # written at once


@pytest.mark.django_db(transaction=True)
def test_inside_an_outer_transaction_the_row_is_written_at_once() -> None:
    # The unit does not own the transaction (ATOMIC_REQUESTS, a caller's atomic()): its store
    # does not commit, so nothing waits for it.
    with transaction.atomic():
        unit = _unit()
        assert isinstance(unit.open(), Run)
        message_id = enqueue_task("tests.noop")
        assert OutboxMessage.objects.filter(pk=message_id).exists()
        unit.close(Result(201, [], b"{}"))
    assert OutboxMessage.objects.filter(pk=message_id).exists()
