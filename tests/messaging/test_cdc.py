"""Events for change data capture on the test database: emit_event() writes one row in the
caller's transaction or refuses; the table is in Debezium's shape and kept by partition
maintenance; the publication's command and checks (the slot itself: test_cdc_slot.py)."""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test import override_settings

from django_idempotency.checks.cdc import check_cdc
from django_idempotency.engine.work import Result, Run
from django_idempotency.messaging import cdc, emit_event
from django_idempotency.messaging.cdc import publication
from django_idempotency.messaging.outbox import NotInTransaction, OutboxError
from django_idempotency.models import OutboxEvent
from django_idempotency.partitions.catalog import utc_today
from django_idempotency.partitions.maintain import maintain
from django_idempotency.partitions.tables import registered
from tests.messaging.test_outbox import _unit, new_message_id_time

NAME = "test_cdc_events"


def _columns() -> list[tuple[str, str, str]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_name = %s ORDER BY ordinal_position",
            [cdc.TABLE],
        )
        return list(cursor.fetchall())


@pytest.mark.django_db
def test_the_table_has_the_columns_debezium_s_outbox_event_router_reads_by_default() -> None:
    assert _columns() == [
        ("id", "uuid", "NO"),
        ("created_at", "timestamp with time zone", "NO"),
        ("aggregatetype", "character varying", "NO"),
        ("aggregateid", "character varying", "NO"),
        ("type", "character varying", "NO"),
        ("payload", "jsonb", "YES"),
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.partstrat, a.attname FROM pg_partitioned_table p "
            "JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0] "
            "WHERE p.partrelid = %s::regclass",
            [cdc.TABLE],
        )
        assert cursor.fetchone() == ("r", "created_at")


@pytest.mark.django_db(transaction=True)
def test_outside_a_transaction_emit_event_is_refused_and_writes_nothing() -> None:
    with pytest.raises(NotInTransaction, match=r"emit_event\(\) inside transaction\.atomic"):
        emit_event("order", "1", "OrderPlaced", {"id": 1})
    assert not OutboxEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_committed_event_is_one_row_with_its_aggregate_type_and_payload() -> None:
    order = uuid.uuid4()
    with transaction.atomic():
        event_id = emit_event("order", order, "OrderPlaced", {"total": 2499, "lines": [1, 2]})
    row = OutboxEvent.objects.get()
    assert str(row.id) == event_id and uuid.UUID(event_id).version == 7
    assert (row.aggregate_type, row.aggregate_id, row.event_type) == (
        "order",
        str(order),
        "OrderPlaced",
    )
    assert row.payload == {"total": 2499, "lines": [1, 2]}
    assert row.created_at == new_message_id_time(event_id)


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_event_leaves_no_row() -> None:
    with contextlib.suppress(ZeroDivisionError), transaction.atomic():
        emit_event("order", 1, "OrderPlaced", {})
        1 / 0  # noqa: B018
    assert not OutboxEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_null_payload_is_stored_as_sql_null() -> None:
    with transaction.atomic():
        emit_event("order", 1, "OrderForgotten", None)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT payload IS NULL FROM {cdc.TABLE}")
        assert cursor.fetchone() == (True,)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "1", "T", {}), "aggregate type must be a non-empty str"),
        (("order", None, "T", {}), "aggregate id must be a non-empty str"),
        (("order", True, "T", {}), "aggregate id must be a non-empty str"),
        (("order", "1", "x" * 256, {}), "type is 256 characters long; the column holds 255"),
        (("order", "1", "T", {"at": datetime.now(UTC)}), "payload cannot be stored as JSON"),
        (("order", "1", "T", {"x": float("nan")}), "payload cannot be stored as JSON"),
    ],
)
def test_what_the_table_cannot_hold_is_refused_with_the_reason(
    args: tuple[object, ...], message: str
) -> None:
    with pytest.raises(OutboxError, match=message):
        emit_event(*args)  # type: ignore[arg-type]
    assert not OutboxEvent.objects.exists()


@pytest.mark.django_db
def test_a_cloudevents_envelope_wraps_the_payload_by_setting_or_per_call() -> None:
    with override_settings(
        IDEMPOTENCY_CDC_CLOUDEVENTS=True, IDEMPOTENCY_CDC_CLOUDEVENTS_SOURCE="https://shop.test/"
    ):
        wrapped = emit_event("order", 7, "com.shop.order.placed", {"total": 5})
        plain = emit_event("order", 7, "com.shop.order.placed", {"total": 5}, cloudevents=False)
    also = emit_event("order", 7, "OrderPaid", [1], cloudevents=True)

    envelope = OutboxEvent.objects.get(id=wrapped).payload
    assert envelope == {
        "specversion": "1.0",
        "id": wrapped,
        "source": "https://shop.test/order",
        "type": "com.shop.order.placed",
        "subject": "7",
        "time": envelope["time"],
        "datacontenttype": "application/json",
        "data": {"total": 5},
    }
    assert datetime.fromisoformat(envelope["time"]) == new_message_id_time(wrapped)
    assert envelope["time"].endswith("Z")
    assert OutboxEvent.objects.get(id=plain).payload == {"total": 5}
    other = OutboxEvent.objects.get(id=also).payload
    assert other["source"] == "/django-idempotency/order" and other["data"] == [1]


@pytest.mark.django_db(transaction=True)
def test_in_a_unit_of_work_the_event_travels_with_the_store_and_its_commit() -> None:
    unit = _unit()
    assert isinstance(unit.open(), Run)
    event_id = emit_event("order", 1, "OrderPlaced", {"n": 1})
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {cdc.TABLE}")
        assert cursor.fetchone() == (0,)  # rides with the store, not sent yet
    assert unit.close(Result(201, [], b"{}")) is True
    assert [str(pk) for pk in OutboxEvent.objects.values_list("id", flat=True)] == [event_id]

    unit = _unit()
    assert isinstance(unit.open(), Run)
    emit_event("order", 1, "OrderPaid", {"n": 2})
    unit.fail(ValueError("the work raised"))
    assert OutboxEvent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_maintenance_keeps_the_event_table_ahead_and_drops_days_past_cdc_retention() -> None:
    assert cdc.EVENTS in registered()
    today = utc_today()
    with transaction.atomic():
        emit_event("order", 1, "OrderPlaced", {})
    noon = datetime(today.year, today.month, today.day, 12, tzinfo=UTC)

    def dropped(retention: timedelta, now: datetime) -> list[str]:
        with override_settings(IDEMPOTENCY_CDC_RETENTION=retention):
            report = maintain(now=now, tables=[cdc.EVENTS], drop=True, dry_run=True)
        assert report.plan is not None
        return [partition.name for partition in report.plan.tables[0].drop]

    # Rows are dropped by day, a full retention after their day ends, whether read or not.
    assert cdc.EVENTS.partition_name(today) not in dropped(timedelta(days=7), noon + timedelta(7))
    assert cdc.EVENTS.partition_name(today) in dropped(timedelta(days=7), noon + timedelta(8))
    report = maintain(tables=[cdc.EVENTS])
    assert report.future[cdc.TABLE] >= 2


# The publication: its SQL, the command, the checks -------------------------------------


def _state(**changes: object) -> publication.State:
    fields = {
        "publication": NAME,
        "wal_level": "logical",
        "exists": True,
        "includes_table": True,
        "via_root": True,
        "publishes_inserts": True,
        "slots": (),
        **changes,
    }
    return publication.State(**fields)  # type: ignore[arg-type]


def test_the_sql_creates_a_missing_publication_and_mends_one_that_falls_short() -> None:
    table = f'"{cdc.TABLE}"'
    assert publication.statements("default", _state(exists=False)) == [
        f'CREATE PUBLICATION "{NAME}" FOR TABLE {table} '
        "WITH (publish = 'insert', publish_via_partition_root = true)"
    ]
    assert publication.statements("default", _state()) == []
    assert publication.statements("default", _state(includes_table=False, via_root=False)) == [
        f'ALTER PUBLICATION "{NAME}" ADD TABLE {table}',
        f'ALTER PUBLICATION "{NAME}" SET (publish_via_partition_root = true)',
    ]
    # Not mended: the publication's owner decides what it publishes for its other tables.
    assert publication.statements("default", _state(publishes_inserts=False)) == []
    assert _state(publishes_inserts=False).problems() == [
        f"publication {NAME!r} does not publish inserts"
    ]


@pytest.mark.django_db
def test_the_command_creates_the_publication_and_the_checks_then_see_it() -> None:
    with override_settings(IDEMPOTENCY_CDC_PUBLICATION=NAME):
        before = {m.id for m in check_cdc(None, databases=["default"])}
        out = StringIO()
        call_command("idempotency_cdc", "publication", "--sql", stdout=out)
        assert out.getvalue().startswith(f'CREATE PUBLICATION "{NAME}" FOR TABLE')
        call_command("idempotency_cdc", "publication", stdout=StringIO())
        found = publication.state("default", NAME)
        after = {m.id for m in check_cdc(None, databases=["default"])}
        out = StringIO()
        call_command("idempotency_cdc", "publication", stdout=out)
    assert "django_idempotency.W130" in before
    assert found.exists and found.includes_table and found.via_root and found.publishes_inserts
    assert not after & {"django_idempotency.W130", "django_idempotency.W131"}
    assert "nothing to do" in out.getvalue()


@pytest.mark.django_db
def test_a_publication_that_sends_each_partition_as_its_own_table_is_w131_and_mended() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE PUBLICATION "{NAME}" FOR TABLE {cdc.TABLE}')
    with override_settings(IDEMPOTENCY_CDC_PUBLICATION=NAME):
        [warning] = [
            m for m in check_cdc(None, databases=["default"]) if m.id != "django_idempotency.W132"
        ]
        out = StringIO()
        call_command("idempotency_cdc", "publication", stdout=out)
        remaining = [m.id for m in check_cdc(None, databases=["default"])]
    assert warning.id == "django_idempotency.W131"
    assert "publish_via_partition_root is off" in warning.msg
    assert "idempotency_cdc publication --sql" in warning.hint
    assert (
        out.getvalue().strip()
        == f'ALTER PUBLICATION "{NAME}" SET (publish_via_partition_root = true);'
    )
    assert "django_idempotency.W131" not in remaining


@pytest.mark.django_db
def test_without_the_setting_the_checks_are_silent_and_the_command_asks_for_a_name() -> None:
    assert check_cdc(None, databases=["default"]) == []
    with pytest.raises(CommandError, match="Set IDEMPOTENCY_CDC_PUBLICATION"):
        call_command("idempotency_cdc", "status")


def test_a_server_without_logical_wal_is_w132() -> None:
    from django_idempotency.checks.cdc import _messages

    [message] = _messages("default", _state(wal_level="replica"))
    assert message.id == "django_idempotency.W132" and "wal_level = logical" in message.hint


@pytest.mark.django_db
def test_status_says_what_is_missing_and_exits_1() -> None:
    out = StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("idempotency_cdc", "--publication", NAME, "status", stdout=out)
    assert raised.value.returncode == 1
    assert f"publication {NAME!r} does not exist" in out.getvalue()


@pytest.mark.django_db
def test_a_role_that_may_not_create_it_is_told_to_hand_the_sql_over() -> None:
    role = f"cdc_app_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{role}"')
        cursor.execute(f'GRANT SELECT ON {cdc.TABLE} TO "{role}"')
        cursor.execute(f'SET LOCAL ROLE "{role}"')
    with pytest.raises(CommandError) as raised:
        call_command("idempotency_cdc", "--publication", NAME, "publication")
    message = str(raised.value)
    assert "may not create the publication" in message
    assert "idempotency_cdc publication --sql" in message
    with connection.cursor() as cursor:
        cursor.execute("RESET ROLE")


def test_the_cloudevents_time_is_rfc_3339_in_utc_to_the_millisecond() -> None:
    envelope = cdc.cloudevent(
        uuid.UUID(int=1), datetime(2026, 11, 27, 9, 54, 12, 345000, UTC), "order", "1", "T", {}
    )
    assert envelope["time"] == "2026-11-27T09:54:12.345Z"
