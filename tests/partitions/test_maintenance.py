"""Maintenance runs on a real PostgreSQL: what they create and drop, dry runs, pending
detaches, two runs at once, live claims behind a long transaction, and batched deletes
where the table is not partitioned (PostgreSQL and SQLite)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_idempotency import signals
from django_idempotency.partitions import apply, catalog, tables
from django_idempotency.partitions.catalog import day_bounds
from django_idempotency.partitions.maintain import (
    MAINTENANCE_LOCK,
    MaintenanceFailed,
    Report,
    maintain,
)
from django_idempotency.partitions.tables import RECORDS, PartitionedTable
from tests.support.partitions import (
    attach_foreign,
    detach_and_drop,
    execute,
    insert_record,
    make_partitions,
    table_names,
    today,
)

TABLE = RECORDS.table
partition_name = RECORDS.partition_name

# Every test here commits DDL, except the one that swaps the table inside its transaction.
sandboxed = pytest.mark.usefixtures("partition_sandbox")


def old_partitions(*ages: int) -> list[str]:
    """Our partitions ``ages`` days ago, with a record each."""
    days = [today() - timedelta(days=age) for age in ages]
    make_partitions(*days)
    for day in days:
        insert_record(day_bounds(day)[0] + timedelta(hours=12), timedelta(hours=24))
    return [partition_name(day) for day in days]


def live_names() -> set[str]:
    return {p.name for p in catalog.list_partitions(connection, RECORDS) if p.live}


@pytest.fixture
def sent() -> Iterator[list[tuple[str, list[str], str]]]:
    received: list[tuple[str, list[str], str]] = []

    def created(sender: Any, names: list[str], using: str, **kwargs: Any) -> None:
        received.append(("created", names, using))

    def dropped(sender: Any, names: list[str], using: str, **kwargs: Any) -> None:
        received.append(("dropped", names, using))

    signals.partitions_created.connect(created)
    signals.partitions_dropped.connect(dropped)
    yield received
    signals.partitions_created.disconnect(created)
    signals.partitions_dropped.disconnect(dropped)


@sandboxed
def test_creates_missing_partitions_and_drops_only_our_expired_ones(
    sent: list[tuple[str, list[str], str]],
) -> None:
    expired = old_partitions(10, 9)
    recent = old_partitions(1)  # yesterday's: its records may still be replayed
    missing = [today() + timedelta(days=n) for n in (2, 3)]
    detach_and_drop(*missing)
    foreign = f"{TABLE}_p20200101"
    start, end = day_bounds(date(2020, 1, 1))
    attach_foreign(foreign, start, end)
    unattached = partition_name(today() - timedelta(days=30))
    execute(f'CREATE TABLE "{unattached}" (LIKE {TABLE})')

    report = maintain(
        tables=[RECORDS]
    )  # the outbox has its own test (tests/messaging/test_outbox.py)

    assert report.created == [partition_name(day) for day in missing]
    assert report.dropped == expired
    assert not set(expired) & table_names()
    assert {foreign, unattached, *recent, *report.created} <= table_names()
    assert {foreign, *recent, *report.created} <= live_names()
    assert report.future_partitions == 7 and report.future == {TABLE: 7}
    assert sent == [("created", report.created, "default"), ("dropped", expired, "default")]
    # Nothing is left to do.
    again = maintain(tables=[RECORDS])
    assert again.plan is not None and again.plan.empty
    assert not again.created and not again.dropped


@sandboxed
def test_dry_run_prints_the_plan_and_changes_nothing() -> None:
    (expired,) = old_partitions(12)
    missing = today() + timedelta(days=4)
    detach_and_drop(missing)
    before = table_names()
    out = StringIO()
    call_command("idempotency_partitions", "--dry-run", stdout=out)
    assert table_names() == before
    text = out.getvalue()
    assert "plan (dry run, nothing changed)" in text
    assert f"create           {partition_name(missing)}" in text
    assert f"detach and drop  {expired}" in text
    assert f"keep             {partition_name(today())}  (current)" in text
    assert f"7 future partitions of {TABLE}" in text  # once the plan is applied


@sandboxed
def test_no_drop_only_creates() -> None:
    (expired,) = old_partitions(12)
    missing = today() + timedelta(days=4)
    detach_and_drop(missing)
    out = StringIO()
    call_command("idempotency_partitions", "--no-drop", stdout=out)
    assert f"created {partition_name(missing)}" in out.getvalue()
    assert expired in live_names()


@sandboxed
@override_settings(IDEMPOTENCY_DROP_PARTITIONS=False)
def test_drop_partitions_setting_off_keeps_expired_partitions() -> None:
    (expired,) = old_partitions(12)
    report = maintain()
    assert report.dropped == []
    assert expired in live_names()
    assert maintain(drop=True).dropped == [expired]


@sandboxed
@override_settings(
    IDEMPOTENCY_MAX_TTL=timedelta(days=3),
    IDEMPOTENCY_CONSUMER_TTL=timedelta(days=1),
    IDEMPOTENCY_EXPIRED_WINDOW=timedelta(days=2),
    IDEMPOTENCY_PARTITION_GRACE=timedelta(hours=1),
)
def test_retention_is_max_ttl_plus_expired_window_plus_grace() -> None:
    # At noon, partitions that ended 5 days + 1 hour ago or earlier go: the one that ended
    # 5 days ago (age 6) goes, the one that ended 4 days ago (age 5) stays.
    kept = old_partitions(5, 4)
    dropped = old_partitions(7, 6)
    report = maintain(now=day_bounds(today())[0] + timedelta(hours=12))
    assert report.dropped == dropped
    assert set(kept) <= live_names()


def hold_transaction(started: threading.Event, release: threading.Event) -> None:
    """An open transaction that has read every partition (as a slow request or report)."""
    own = connections["default"]
    try:
        with transaction.atomic(), own.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {TABLE}")
            started.set()
            release.wait(30)
    finally:
        own.close()


def leave_detach_pending(name: str) -> None:
    """Start a concurrent detach that times out waiting for an open transaction."""
    started, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_transaction, args=(started, release))
    holder.start()
    started.wait(10)
    other = connection.copy()
    try:
        with other.cursor() as cursor:
            cursor.execute("SET lock_timeout = '50ms'")
            with pytest.raises(Exception, match="lock timeout"):
                cursor.execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{name}" CONCURRENTLY')
    finally:
        other.close()
        release.set()
        holder.join()


@sandboxed
def test_finishes_a_pending_detach_and_drops_the_partition_if_ours_and_expired() -> None:
    (expired,) = old_partitions(11)
    leave_detach_pending(expired)
    assert [p.name for p in catalog.list_partitions(connection, RECORDS) if p.detach_pending] == [
        expired
    ]
    report = maintain()
    assert report.dropped == [expired]
    assert expired not in table_names()


@sandboxed
def test_finishes_a_foreign_pending_detach_and_keeps_the_table() -> None:
    # PostgreSQL allows one pending detach per table: it must be finished before ours.
    (expired,) = old_partitions(11)
    foreign = f"{TABLE}_p20200101"
    attach_foreign(foreign, *day_bounds(date(2020, 1, 1)))
    leave_detach_pending(foreign)
    report = maintain()
    assert report.finalized == [foreign]
    assert report.dropped == [expired]
    assert foreign in table_names() and foreign not in live_names()


@sandboxed
def test_drops_a_table_that_an_interrupted_run_left_detached() -> None:
    leftover, kept = old_partitions(9, 8)
    for name in (leftover, kept):
        execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{name}"')
    # The run marks a partition before detaching it; an operator's detach leaves no mark.
    execute(f"COMMENT ON TABLE \"{leftover}\" IS '{catalog.DROPPING_COMMENT}'")
    report = maintain()
    assert report.dropped == [leftover]
    assert kept in table_names()


@sandboxed
def test_a_name_taken_by_another_table_fails_that_step_only() -> None:
    taken, missing = today() + timedelta(days=3), today() + timedelta(days=4)
    detach_and_drop(taken, missing)
    execute(f'CREATE TABLE "{partition_name(taken)}" (note text)')
    (expired,) = old_partitions(10)
    with pytest.raises(MaintenanceFailed, match="not a partition") as failed:
        maintain()
    report = failed.value.report
    assert report.created == [partition_name(missing)]
    assert report.dropped == [expired]
    out = StringIO()
    with pytest.raises(CommandError, match="not a partition"):
        call_command("idempotency_partitions", stdout=out)
    assert "error: create" in out.getvalue()


@sandboxed
def test_logs_an_error_when_fewer_than_two_future_partitions_exist(
    caplog: pytest.LogCaptureFixture,
) -> None:
    detach_and_drop(*(today() + timedelta(days=n) for n in range(2, 8)))
    with override_settings(IDEMPOTENCY_PARTITIONS_AHEAD=1):
        report = maintain()
    assert report.future_partitions == 1
    errors = [r for r in caplog.records if r.name == "django_idempotency.partitions"]
    assert [r.levelname for r in errors] == ["ERROR"]
    assert "Only 1 future partitions" in errors[0].getMessage()
    caplog.clear()
    maintain()
    assert not [
        r
        for r in caplog.records
        if r.name == "django_idempotency.partitions" and r.levelname == "ERROR"
    ]


@sandboxed
def test_maintenance_creates_utc_days_whatever_the_time_zone() -> None:
    detach_and_drop(today() + timedelta(days=4))
    with override_settings(TIME_ZONE="Pacific/Kiritimati"):
        execute("SET TIME ZONE 'Pacific/Pago_Pago'")  # UTC-11: 25 hours behind Kiritimati
        try:
            report = maintain()
        finally:
            execute("RESET TIME ZONE")
    assert report.created == [partition_name(today() + timedelta(days=4))]
    for p in catalog.list_partitions(connection, RECORDS):
        day = RECORDS.partition_day(p.name)
        assert day is not None and (p.lower, p.upper) == day_bounds(day)


@sandboxed
def test_maintenance_inside_a_transaction_runs_on_its_own_connection() -> None:
    (expired,) = old_partitions(10)
    with transaction.atomic():
        report = maintain()
    assert report.dropped == [expired]
    assert expired not in table_names()


def maintenance_lock_held() -> bool:
    """Whether a session holds the maintenance run's lock on this test's database; another
    database on the same server may hold locks of its own."""
    return bool(
        execute(
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND classid::bigint = (hashtextextended(%s, 0) >> 32) & 4294967295 "
            "AND objid::bigint = hashtextextended(%s, 0) & 4294967295",
            [MAINTENANCE_LOCK, MAINTENANCE_LOCK],
        )
    )


@sandboxed
def test_two_runs_at_once_one_works_and_the_other_skips() -> None:
    (expired,) = old_partitions(10)
    started, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_transaction, args=(started, release))
    holder.start()
    started.wait(10)
    reports: list[Report] = []

    def first_run() -> None:
        try:
            reports.append(maintain())
        finally:
            connections["default"].close()

    first = threading.Thread(target=first_run)
    first.start()
    # The first run holds the lock while its detach waits for the open transaction.
    deadline = time.monotonic() + 10
    while not maintenance_lock_held():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    out = StringIO()
    call_command("idempotency_partitions", stdout=out)
    second = maintain()
    release.set()
    holder.join()
    first.join()
    assert "another maintenance run holds the lock; skipped" in out.getvalue()
    assert second.skipped and second.plan is None
    assert reports[0].dropped == [expired] and not reports[0].skipped
    # Once the first run is over, the lock is free again.
    assert not maintain().skipped


# Each statement reports how long it took inside the server, lock waits included:
# client-side timings on a loaded test machine mostly measure the GIL and the scheduler.
SPENT = "extract(epoch FROM clock_timestamp() - statement_timestamp())"
CLAIM = f"SELECT outcome, created_at, {SPENT} FROM django_idempotency_claim(%s, %s, %s, %s, %s, %s)"
FINISH = (
    f"INSERT INTO {TABLE} (scope, key, method, path, fingerprint, status, response_code, "
    "response_body, created_at, expires_at) "
    "VALUES ('traffic', %s, 'POST', '/charges', '{}', 1, 201, '\\x7b7d', %s, %s) "
    f"RETURNING {SPENT}"
)


@dataclass(frozen=True)
class Claimed:
    at: float
    client: float  # seconds, as the caller saw it
    server: float  # seconds spent in the database by the claim and the insert


def claim_traffic(
    stop: threading.Event, claims: list[Claimed], errors: list[BaseException]
) -> None:
    """Requests as the engine makes them: claim, store the finished record, commit."""
    own = connections["default"]
    try:
        while not stop.is_set():
            key = uuid.uuid4().hex
            started = time.monotonic()
            with transaction.atomic(), own.cursor() as cursor:
                lock = random.randrange(-(2**31), 2**31)  # the engine hashes the key into it
                cursor.execute(CLAIM, [lock, "traffic", key, timedelta(hours=24), timedelta(0), 0])
                outcome, created_at, claiming = cursor.fetchone()
                assert outcome == "won", outcome
                cursor.execute(FINISH, [key, created_at, created_at + timedelta(hours=24)])
                (storing,) = cursor.fetchone()
            took = time.monotonic() - started
            claims.append(Claimed(started, took, float(claiming) + float(storing)))
            time.sleep(0.005)
    except BaseException as exc:
        errors.append(exc)
    finally:
        own.close()


def behind_a_long_transaction(action: Callable[[], object]) -> tuple[list[Claimed], float]:
    """Run ``action`` under claim traffic while a transaction that has read every
    partition stays open for 2 more seconds; return the claims made while it ran, and how
    long it took."""
    stop = threading.Event()
    claims: list[Claimed] = []
    errors: list[BaseException] = []
    clients = [
        threading.Thread(target=claim_traffic, args=(stop, claims, errors)) for _ in range(6)
    ]
    for client in clients:
        client.start()
    time.sleep(0.5)
    started, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_transaction, args=(started, release))
    holder.start()
    started.wait(10)
    release_timer = threading.Timer(2.0, release.set)
    release_timer.start()
    try:
        begun = time.monotonic()
        action()
        ended = time.monotonic()
    finally:
        release.set()
        holder.join()
        time.sleep(0.3)
        stop.set()
        for client in clients:
            client.join()
    assert errors == []
    return [c for c in claims if begun <= c.at <= ended], ended - begun


@sandboxed
def test_live_claims_never_wait_while_maintenance_works_behind_a_long_transaction() -> None:
    """CONTRACT 10: maintenance never makes a live request wait more than 100 ms, even
    while long transactions are open. The open transaction has read the partitions being
    dropped, so their detach must wait for it: the run takes as long, claims do not."""
    expired = old_partitions(10, 9)
    missing = today() + timedelta(days=4)
    detach_and_drop(missing)
    reports: list[Report] = []
    during, took = behind_a_long_transaction(lambda: reports.append(maintain()))
    assert reports[0].created == [partition_name(missing)]
    assert reports[0].dropped == expired
    assert took > 1.5
    assert len(during) > 100
    slowest = max(c.server for c in during)
    assert slowest < 0.1, f"a claim spent {slowest * 1000:.0f} ms in the database"


@sandboxed
def test_control_a_plain_drop_stalls_claims_behind_the_long_transaction() -> None:
    """The measurement above can fail: a plain DROP of an attached partition queues for
    an exclusive lock behind the open transaction, and every claim queues behind it."""
    (expired,) = old_partitions(10)
    during, took = behind_a_long_transaction(lambda: execute(f'DROP TABLE "{expired}"'))
    assert took > 1.5
    assert max(c.server for c in during) > 1.0


def test_deletes_expired_records_in_batches_where_the_table_is_not_partitioned(
    db: None,
) -> None:
    # Swapped for a plain table inside the test's transaction, rolled back afterwards.
    execute(f"ALTER TABLE {TABLE} RENAME TO partitioned_away")
    execute(f"CREATE TABLE {TABLE} (LIKE partitioned_away INCLUDING ALL)")
    now = catalog.database_now(connection)
    for n in range(10):
        insert_record(now - timedelta(days=3), timedelta(hours=24), key=f"expired{n}")
    insert_record(now - timedelta(hours=24, minutes=30), timedelta(hours=24), key="gone")
    insert_record(now, timedelta(hours=24), key="live")
    with override_settings(
        IDEMPOTENCY_DELETE_BATCH_SIZE=3, IDEMPOTENCY_EXPIRED_WINDOW=timedelta(hours=1)
    ):
        # The records alone: the outbox, still partitioned, would add a plan.
        dry = maintain(dry_run=True, tables=[RECORDS])
        with CaptureQueriesContext(connection) as queries:
            report = maintain(tables=[RECORDS])
    assert dry.deleted == {TABLE: 10} and dry.plan is None
    deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("DELETE")]
    assert len(deletes) == 4  # 3 + 3 + 3 + 1
    assert execute(f"SELECT key FROM {TABLE} ORDER BY key") == [("gone",), ("live",)]
    assert report.deleted == {TABLE: 10}
    assert report.lines() == [f"default: {TABLE} not partitioned; deleted 10 expired rows"]


SQLITE_SCRIPT = """
import json
from datetime import timedelta
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_idempotency.models import IdempotencyRecord

call_command("migrate", verbosity=0)
now = timezone.now()
for n, age in enumerate([timedelta(days=2)] * 7 + [timedelta(hours=24, minutes=30), timedelta(0)]):
    IdempotencyRecord.objects.create(
        scope="s", key=f"k{n}", method="POST", path="/p", fingerprint={},
        created_at=now - age, expires_at=now - age + timedelta(hours=24))
with CaptureQueriesContext(connection) as queries:
    call_command("idempotency_partitions")
print(json.dumps({
    "left": sorted(IdempotencyRecord.objects.values_list("key", flat=True)),
    "deletes": sum(q["sql"].startswith("DELETE") for q in queries.captured_queries),
}))
"""


def test_deletes_expired_records_in_batches_on_sqlite(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "sqlite_settings.py").write_text(
        textwrap.dedent(f"""
        INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth",
                          "django_idempotency"]
        DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3",
                                   "NAME": {str(tmp_path / "db.sqlite3")!r}}}}}
        USE_TZ = True
        SECRET_KEY = "test"
        IDEMPOTENCY_DELETE_BATCH_SIZE = 2
        IDEMPOTENCY_EXPIRED_WINDOW = __import__("datetime").timedelta(hours=1)
        """)
    )
    env = {
        **subprocess_env,
        "DJANGO_SETTINGS_MODULE": "sqlite_settings",
        "PYTHONPATH": f"{tmp_path}:{subprocess_env['PYTHONPATH']}",
    }
    result = subprocess.run(
        [sys.executable, "-c", SQLITE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    # Seven expired (4 batches of 2), one in its gone window, one live.
    assert outcome == {"left": ["k7", "k8"], "deletes": 4}


@sandboxed
def test_a_step_that_cannot_get_its_lock_in_time_fails_and_the_others_are_done() -> None:
    (expired,) = old_partitions(10)
    missing = today() + timedelta(days=4)
    detach_and_drop(missing)
    # Another session creating partitions holds the lock that creators take in turn.
    other = connection.copy()
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [apply.CREATE_LOCK]
            )
            with pytest.raises(MaintenanceFailed, match="lock timeout") as failed:
                maintain(retry_for=timedelta(seconds=0.5))
            cursor.execute("ROLLBACK")
    finally:
        other.close()
    report = failed.value.report
    assert report is not None
    assert report.created == [] and report.dropped == [expired]
    assert report.errors[0].startswith(f"create {partition_name(missing)}: ")
    # Left for the next run.
    assert maintain().created == [partition_name(missing)]


@sandboxed
def test_a_failing_signal_receiver_is_logged_and_the_run_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (expired,) = old_partitions(10)

    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.partitions_dropped.connect(broken)
    try:
        report = maintain()
    finally:
        signals.partitions_dropped.disconnect(broken)
    assert report.dropped == [expired]
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.name == "django.dispatch" and record.exc_info is not None


def test_without_the_table_maintenance_says_to_run_migrate(db: None) -> None:
    execute(f"ALTER TABLE {TABLE} RENAME TO moved_away")
    with pytest.raises(MaintenanceFailed, match="does not exist; run migrate"):
        maintain()


# Another partitioned table, as the messaging tables register theirs.
EVENTS = PartitionedTable(
    table="maintenance_test_events",
    column="created_at",
    keep_for=lambda: timedelta(days=3),
)


@pytest.fixture
def events_table(
    partition_sandbox: None,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[None]:
    """A second table partitioned by day, registered as another module of the package would."""
    execute(
        "CREATE TABLE maintenance_test_events (id bigint, created_at timestamptz NOT NULL) "
        "PARTITION BY RANGE (created_at)"
    )
    # The records and this one (the outbox, also registered, has its own test).
    monkeypatch.setattr(
        tables, "TABLES", (tables.TABLES[0], "tests.partitions.test_maintenance.EVENTS")
    )
    yield
    execute("DROP TABLE maintenance_test_events")  # and its partitions


def test_every_registered_table_is_created_ahead_and_dropped_by_the_same_run(
    events_table: None, sent: list[tuple[str, list[str], str]]
) -> None:
    day = today()
    old, recent = make_partitions(
        day - timedelta(days=5), day - timedelta(days=2), table=EVENTS
    )  # ended 4 days ago (past 3 days' retention) and 1 day ago
    theirs = "maintenance_test_events_p20200101"
    execute(
        f"CREATE TABLE {theirs} PARTITION OF maintenance_test_events "
        "FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2020-01-02 00:00+00')"
    )
    missing = day + timedelta(days=4)
    detach_and_drop(missing)

    dry = maintain(dry_run=True)
    assert dry.plan is not None
    assert [plan.table for plan in dry.plan.tables] == [RECORDS, EVENTS]
    assert f"detach and drop  {old}" in "\n".join(dry.lines())
    assert table_names("maintenance_test_events") == {old, recent, theirs}

    report = maintain()

    ahead = [EVENTS.partition_name(day + timedelta(days=n)) for n in range(8)]
    assert report.created == [partition_name(missing), *ahead]
    assert report.dropped == [old]
    assert report.future == {TABLE: 7, EVENTS.table: 7}
    assert table_names("maintenance_test_events") == {recent, theirs, *ahead}
    assert sent == [("created", report.created, "default"), ("dropped", [old], "default")]
    execute("INSERT INTO maintenance_test_events VALUES (1, now())")  # today's partition takes it
    again = maintain().plan
    assert again is not None and again.empty
