"""The operator-time telemetry through OpenTelemetry: the partition and outbox gauges read at
scrape time, the relay's receivers and ``connect()``, through the SDK's in-memory exporters;
and the names it keeps importable."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction

pytest.importorskip("opentelemetry.sdk")

from django_idempotency import signals, telemetry
from django_idempotency.engine import instrumentation
from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.partitions import catalog
from django_idempotency.partitions.tables import RECORDS, registered
from tests.support.claims import unreachable_store
from tests.support.otel import collect_fixture, sdk_fixture  # noqa: F401  (the fixtures)


@pytest.mark.django_db
def test_partition_headroom_is_the_time_until_the_first_day_without_a_partition(
    collect: Any,
) -> None:
    now = catalog.database_now(connection)
    missing = now.date() + timedelta(days=3)
    with connection.cursor() as cursor:
        # Undone with the test's transaction.
        cursor.execute(
            f'ALTER TABLE {RECORDS.table} DETACH PARTITION "{RECORDS.partition_name(missing)}"'
        )
    telemetry.forget_readings()  # the fixture's collection read the partitions before
    got = collect()
    (days,) = got.gauge(telemetry.PARTITION_HEADROOM, database="default", table=RECORDS.table)
    start_of_missing = datetime(missing.year, missing.month, missing.day, tzinfo=UTC)
    expected = (start_of_missing - now).total_seconds() / 86400
    assert abs(days - expected) < 0.01
    assert 2 < days <= 3
    (outbox_days,) = got.gauge(telemetry.PARTITION_HEADROOM, table="django_idempotency_outbox")
    assert outbox_days > 5


@pytest.mark.django_db
def test_a_database_that_cannot_be_read_gives_no_gauge_and_the_others_still_do(
    settings, collect: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with unreachable_store(settings) as alias:
        monkeypatch.setattr(telemetry, "_aliases", lambda model: iter(["default", alias]))
        telemetry.forget_readings()
        got = collect()
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database=alias) == []
    assert got.gauge(telemetry.PARTITION_HEADROOM, database=alias) == []
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [0]
    # One per partitioned table: the records, the outbox, the CDC events.
    assert len(got.gauge(telemetry.PARTITION_HEADROOM, database="default")) == len(registered())
    assert f"could not read database '{alias}'" in caplog.text


@pytest.mark.django_db
def test_connecting_twice_registers_each_gauge_and_receiver_once(collect: Any) -> None:
    telemetry.connect()
    telemetry.connect()
    got = collect()
    assert len(got.gauge(telemetry.OUTBOX_BACKLOG, database="default")) == 1
    for signal in (signals.outbox_published, signals.outbox_redriven):
        receivers = [r for r in signal.receivers if "telemetry" in str(r[0])]
        assert len(receivers) == 1


@pytest.mark.django_db
def test_outbox_backlog_and_oldest_age_are_gauges_cached_for_a_minute(collect: Any) -> None:
    got = collect()
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [0]
    assert got.gauge(telemetry.OUTBOX_OLDEST_AGE, database="default") == [0]
    telemetry.forget_readings()
    with transaction.atomic():
        enqueue_task("tests.telemetry.noop", (1,))
        enqueue_task("tests.telemetry.noop", (2,))
    time.sleep(0.2)
    got = collect()
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [2]
    (age,) = got.gauge(telemetry.OUTBOX_OLDEST_AGE, database="default")
    assert 0.2 <= age < 60
    # Read again within the minute: the same reading, no query.
    with transaction.atomic():
        enqueue_task("tests.telemetry.noop", (3,))
    again = collect()
    assert again.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [2]


@pytest.mark.django_db
def test_dead_letters_are_a_gauge_of_their_own_and_leave_the_backlog(collect: Any) -> None:
    from django.utils import timezone

    from django_idempotency.models import OutboxMessage

    with transaction.atomic():
        dead = enqueue_task("tests.telemetry.noop", (1,))
        enqueue_task("tests.telemetry.noop", (2,))
    OutboxMessage.objects.filter(id=dead).update(dead_at=timezone.now(), attempts=10)
    telemetry.forget_readings()
    got = collect()
    assert got.gauge(telemetry.OUTBOX_DEAD, database="default") == [1]
    assert got.gauge(telemetry.OUTBOX_BACKLOG, database="default") == [1]


@pytest.mark.django_db
def test_the_relay_heartbeat_age_is_read_at_each_scrape_and_absent_without_a_relay(
    collect: Any,
) -> None:
    from django.utils import timezone

    from django_idempotency.models import RelayHeartbeat

    assert collect().gauge(telemetry.RELAY_HEARTBEAT_AGE, database="default") == []
    now = timezone.now()
    for owner, seconds in (("fresh", 12), ("older", 300)):
        beat = now - timedelta(seconds=seconds)
        RelayHeartbeat.objects.create(owner=owner, host="h", pid=1, started_at=beat, beat_at=beat)
    (age,) = collect().gauge(telemetry.RELAY_HEARTBEAT_AGE, database="default")
    assert 12 <= age < 60  # the freshest relay's
    # Not cached like the backlog: a relay that beats again is seen at once.
    RelayHeartbeat.objects.filter(owner="fresh").update(beat_at=timezone.now())
    (again,) = collect().gauge(telemetry.RELAY_HEARTBEAT_AGE, database="default")
    assert again < 12


@pytest.mark.django_db(transaction=True)
def test_relay_lag_is_recorded_per_published_message(collect: Any) -> None:
    pytest.importorskip("celery")
    from celery import Celery

    from django_idempotency.messaging.relay.loop import Relay

    with transaction.atomic():
        for n in range(3):
            enqueue_task("tests.telemetry.noop", (n,))
    time.sleep(0.1)
    app = Celery(f"telemetry-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    assert Relay(app=app).drain() == 3
    got = collect()
    (lag,) = got.recorded(telemetry.RELAY_LAG, database="default")
    assert lag.count == 3
    assert 0.3 <= lag.sum < 60


def test_relay_lag_of_an_id_derived_from_its_request_counts_from_its_row(collect: Any) -> None:
    # A version 8 id says no time; the row's created_at, sent with it, does.
    enqueued = datetime.now(UTC) - timedelta(seconds=30)
    derived = str(uuid.UUID(int=(0x8 << 76) | (0x2 << 62)))
    signals.outbox_published.send_robust(None, ids=[derived], enqueued=[enqueued], using="default")
    (lag,) = collect().recorded(telemetry.RELAY_LAG, database="default")
    assert lag.count == 1 and 30 <= lag.sum < 90


def test_messages_the_redrive_published_again_are_counted(collect: Any) -> None:
    signals.outbox_redriven.send_robust(None, ids=["a", "b"], using="default")
    signals.outbox_redriven.send_robust(None, ids=["c"], using="other")
    got = collect()
    assert got.count(telemetry.OUTBOX_REDRIVEN, database="default") == 2
    assert got.count(telemetry.OUTBOX_REDRIVEN, database="other") == 1


def test_a_message_id_tells_when_it_was_enqueued() -> None:
    from django_idempotency.messaging.outbox import new_message_id

    message_id, created_at = new_message_id()
    assert telemetry.message_time(str(message_id)) == created_at.timestamp()


def test_the_names_that_moved_are_still_importable_from_telemetry() -> None:
    assert telemetry.covered_until is catalog.covered_until
    assert telemetry.listening is instrumentation.listening
    assert telemetry.outcome_of is instrumentation.outcome_of
    assert telemetry.ENABLED is instrumentation.ENABLED
    assert (telemetry.CLAIM_SPAN, telemetry.REQUESTS, telemetry.OUTCOME) == (
        "idempotency.claim",
        "idempotency.requests",
        "idempotency.outcome",
    )
