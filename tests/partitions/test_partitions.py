"""The partitions package: the registry of tables, naming, listing, planning, creating one
partition, the migration's own partitions, and a request that finds no partition.

Tests that leave DDL committed (``transaction=True``) use ``partition_sandbox``, which puts
the partitions back as the migration made them; other modules import it from here.
"""

from __future__ import annotations

import ast
import logging
import sys
import threading
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

import django_idempotency
from django_idempotency.partitions import apply, catalog, tables
from django_idempotency.partitions.catalog import Partition, day_bounds
from django_idempotency.partitions.catalog import database_now as read_database_clock
from django_idempotency.partitions.plan import TablePlan, plan_table
from django_idempotency.partitions.tables import RECORDS, PartitionedTable
from tests.factories import ScriptFactory, new_key
from tests.support.client import problem, send
from tests.support.partitions import (
    TABLE,
    attach_foreign,
    detach_and_drop,
    execute,
    insert_record,
    make_partitions,
    partition_name,
    table_states,
    today,
)
from tests.support.views import business_rows

# The registry -------------------------------------------------------------------------


def test_the_records_table_is_registered_first() -> None:
    assert tables.registered()[0] is RECORDS
    assert (RECORDS.table, RECORDS.column) == ("django_idempotency_record", "created_at")


def test_records_keep_max_ttl_plus_expired_window_plus_grace() -> None:
    with override_settings(
        IDEMPOTENCY_MAX_TTL=timedelta(days=3),
        IDEMPOTENCY_CONSUMER_TTL=timedelta(days=1),
        IDEMPOTENCY_EXPIRED_WINDOW=timedelta(days=2),
        IDEMPOTENCY_PARTITION_GRACE=timedelta(hours=1),
    ):
        assert RECORDS.keep_for() == timedelta(days=5, hours=1)


def test_a_registered_path_that_is_no_table_spec_is_refused(monkeypatch: Any) -> None:
    monkeypatch.setattr(tables, "TABLES", (*tables.TABLES, "django_idempotency.conf.conf"))
    with pytest.raises(TypeError, match="not a PartitionedTable"):
        tables.registered()


# Naming --------------------------------------------------------------------------------


def test_partitions_are_named_and_bounded_by_utc_day() -> None:
    day = date(2026, 3, 29)  # a DST change in Europe: UTC days are still 24 hours
    assert partition_name(day) == "django_idempotency_record_p20260329"
    assert RECORDS.partition_day(partition_name(day)) == day
    start, end = day_bounds(day)
    assert start == datetime(2026, 3, 29, tzinfo=UTC)
    assert end - start == timedelta(days=1)
    assert RECORDS.partition_day("django_idempotency_record_p20261399") is None
    assert RECORDS.partition_day("other_p20261122") is None
    outbox = PartitionedTable("django_idempotency_outbox", "created_at", RECORDS.keep_for)
    assert RECORDS.partition_day(outbox.partition_name(day)) is None


# The migration -------------------------------------------------------------------------

MIGRATIONS = sorted(Path(django_idempotency.__file__).parent.glob("**/migrations/0*.py"))


@pytest.mark.parametrize("path", MIGRATIONS, ids=lambda path: path.name)
def test_migrations_import_nothing_from_the_package(path: Path) -> None:
    """Frozen history: a migration that imported the package would change with it."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name} imports relatively"
            modules.append(node.module or "")
    assert modules
    # The standard library cannot change under a migration; the package and other libraries can.
    allowed = {"django", *sys.stdlib_module_names}
    assert [m for m in modules if m.split(".")[0] not in allowed] == []


def test_the_migration_made_yesterday_to_a_week_ahead_with_our_comment(db: None) -> None:
    found = {p.name: p for p in catalog.list_partitions(connection, RECORDS)}
    # The migration ran when the session began: today, or yesterday in a session that has
    # crossed midnight UTC since.
    migrated_on = [
        day
        for day in (today(), today() - timedelta(days=1))
        if all(partition_name(day + timedelta(days=n)) in found for n in range(-1, 8))
    ]
    assert migrated_on, sorted(found)
    for offset in range(-1, 8):
        day = migrated_on[0] + timedelta(days=offset)
        made = found[partition_name(day)]
        assert (made.lower, made.upper) == day_bounds(day)
        assert made.comment == catalog.PARTITION_COMMENT and made.live


# Listing -------------------------------------------------------------------------------


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kolkata", "America/St_Johns", "Pacific/Kiritimati"])
def test_listing_reads_bounds_in_utc_whatever_the_session_time_zone(db: None, zone: str) -> None:
    execute("SET LOCAL TIME ZONE %s", [zone])
    found = catalog.list_partitions(connection, RECORDS)
    assert len(found) >= 9  # yesterday to today + 7, made by the migration
    for p in found:
        day = RECORDS.partition_day(p.name)
        assert day is not None
        assert (p.lower, p.upper) == day_bounds(day)
        assert p.ours and p.live and not p.default
    assert catalog.database_now(connection).tzinfo == UTC


def test_listing_tells_foreign_default_and_unbounded_partitions_apart(db: None) -> None:
    attach_foreign(
        f"{TABLE}_p20200101", datetime(2020, 1, 1, tzinfo=UTC), datetime(2020, 1, 2, tzinfo=UTC)
    )
    execute(
        f"CREATE TABLE {TABLE}_old PARTITION OF {TABLE} "
        "FOR VALUES FROM (MINVALUE) TO ('2019-01-01 00:00+00')"
    )
    execute(f"CREATE TABLE {TABLE}_rest PARTITION OF {TABLE} DEFAULT")
    found = {p.name: p for p in catalog.list_partitions(connection, RECORDS)}
    foreign = found[f"{TABLE}_p20200101"]
    assert not foreign.ours and foreign.lower == datetime(2020, 1, 1, tzinfo=UTC)
    old = found[f"{TABLE}_old"]
    assert old.lower is None and old.upper == datetime(2019, 1, 1, tzinfo=UTC)
    rest = found[f"{TABLE}_rest"]
    assert rest.default and rest.lower is None and rest.upper is None
    assert catalog.holds(list(found.values()), datetime(2000, 1, 1, tzinfo=UTC))


def test_listing_a_table_shows_none_of_another_tables_leftovers(db: None) -> None:
    execute("CREATE TABLE other_thing (created_at timestamptz) PARTITION BY RANGE (created_at)")
    other = PartitionedTable("other_thing", "created_at", RECORDS.keep_for)
    execute(f"CREATE TABLE other_thing_p20200101 (LIKE {TABLE})")
    execute(f"COMMENT ON TABLE other_thing_p20200101 IS '{catalog.DROPPING_COMMENT}'")
    assert [p.name for p in catalog.list_partitions(connection, other)] == ["other_thing_p20200101"]
    assert "other_thing_p20200101" not in {
        p.name for p in catalog.list_partitions(connection, RECORDS)
    }


def test_table_kind(db: None) -> None:
    assert catalog.table_kind(connection, RECORDS) == "partitioned"
    execute(f"ALTER TABLE {TABLE} RENAME TO moved_away")
    assert catalog.table_kind(connection, RECORDS) is None
    execute(f"CREATE TABLE {TABLE} (id bigint)")
    assert catalog.table_kind(connection, RECORDS) == "plain"


# Planning ------------------------------------------------------------------------------

NOW = datetime(2026, 11, 22, 10, 30, tzinfo=UTC)


def ours(day: date, **fields: Any) -> Partition:
    lower, upper = day_bounds(day)
    return Partition(partition_name(day), lower, upper, catalog.PARTITION_COMMENT, **fields)


def plan_for(found: list[Partition], *, now: datetime = NOW, **options: Any) -> TablePlan:
    options = {"ahead": 4, "keep_for": timedelta(hours=25), "drop": True, **options}
    return plan_table(RECORDS, found, now=now, **options)


def names(items: Any) -> list[str]:
    return [item.name for item in items]


def test_plan_creates_the_missing_days_from_today_to_ahead() -> None:
    day = NOW.date()
    found = [ours(day - timedelta(days=1)), ours(day), ours(day + timedelta(days=2))]
    plan = plan_for(found, ahead=4)
    assert plan.create == (
        day + timedelta(days=1),
        day + timedelta(days=3),
        day + timedelta(days=4),
    )
    assert plan.future_after == 4
    assert not plan.drop and not plan.finalize


def test_plan_creates_no_day_that_a_foreign_partition_covers() -> None:
    day = NOW.date()
    week = Partition(
        "someone_elses_week", day_bounds(day)[0], day_bounds(day + timedelta(days=6))[1], None
    )
    assert plan_for([week], ahead=4).create == ()


def test_plan_drops_our_partitions_that_ended_before_the_cutoff() -> None:
    day = NOW.date()
    # keep_for 25 h: the cutoff is 2026-11-21 09:30, so the 20th (ended 21st 00:00) goes.
    found = [ours(day - timedelta(days=n)) for n in range(3, -5, -1)]
    plan = plan_for(found)
    assert plan.cutoff == NOW - timedelta(hours=25)
    assert names(plan.drop) == [
        partition_name(day - timedelta(days=3)),
        partition_name(day - timedelta(days=2)),
    ]
    kept = dict((p.name, why) for p, why in plan.keep)
    assert kept[partition_name(day - timedelta(days=1))].startswith("holds rows until")
    assert kept[partition_name(day)] == "current"
    assert kept[partition_name(day + timedelta(days=1))] == "future"


def test_plan_never_drops_foreign_default_unbounded_or_current_partitions() -> None:
    day = NOW.date()
    lower, upper = day_bounds(day - timedelta(days=9))
    foreign = Partition(partition_name(day - timedelta(days=9)), lower, upper, None)
    edited = Partition("x", lower, upper, "kept by the DBA")
    unbounded = Partition("old", None, lower, catalog.PARTITION_COMMENT)
    default = Partition("rest", None, None, catalog.PARTITION_COMMENT, default=True)
    plan = plan_for([foreign, edited, unbounded, default, ours(day)], keep_for=timedelta(0))
    # "old" is ours and ended long ago, but a DEFAULT partition blocks every detach.
    assert plan.drop == ()
    assert names(plan_for([foreign, edited, unbounded, ours(day)]).drop) == ["old"]
    assert any("DEFAULT" in note for note in plan.notes)
    assert {p.name for p, _ in plan.keep} == {foreign.name, "x", "old", "rest", ours(day).name}


def test_plan_with_dropping_off_keeps_expired_partitions_but_finishes_pending_detaches() -> None:
    day = NOW.date()
    expired = ours(day - timedelta(days=5))
    pending = ours(day - timedelta(days=6), detach_pending=True)
    plan = plan_for([expired, pending], drop=False)
    assert plan.drop == ()
    assert plan.finalize == (pending,)
    assert dict((p.name, why) for p, why in plan.keep)[expired.name] == (
        "past retention; dropping is off"
    )


def test_plan_finishes_a_foreign_pending_detach_without_dropping_it() -> None:
    lower, upper = day_bounds(NOW.date() - timedelta(days=5))
    foreign = Partition("theirs", lower, upper, None, detach_pending=True)
    plan = plan_for([foreign])
    assert plan.finalize == (foreign,) and plan.drop == ()


def test_plan_drops_a_table_left_detached_by_an_interrupted_run() -> None:
    day = NOW.date() - timedelta(days=5)
    leftover = Partition(
        partition_name(day), *day_bounds(day), catalog.DROPPING_COMMENT, attached=False
    )
    plan = plan_for([leftover])
    assert plan.drop == (leftover,)
    assert any(line.split()[:2] == ["drop", leftover.name] for line in plan.lines())


@given(
    max_ttl=st.timedeltas(min_value=timedelta(minutes=1), max_value=timedelta(days=30)),
    gone=st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=7)),
    grace=st.timedeltas(min_value=timedelta(0), max_value=timedelta(hours=3)),
    created=st.datetimes(
        min_value=datetime(2026, 1, 1), max_value=datetime(2026, 12, 31), timezones=st.just(UTC)
    ),
    later=st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=40)),
)
def test_plan_never_drops_a_record_that_is_replayable_or_in_its_gone_window(
    max_ttl: timedelta, gone: timedelta, grace: timedelta, created: datetime, later: timedelta
) -> None:
    """Whatever the settings and the clock: a partition goes only once all its records would
    be answered as new keys (past expires_at + the 410 window)."""
    now = created + later
    day = created.date()
    plan = plan_for([ours(day)], now=now, keep_for=max_ttl + gone + grace)
    if plan.drop:
        # The latest record a partition can hold, with the longest TTL a view may have.
        latest = day_bounds(day)[1] - timedelta(microseconds=1)
        assert latest + max_ttl + gone < now
    assert (created + max_ttl + gone > now) <= (not plan.drop)


@pytest.mark.parametrize(
    ("max_ttl", "gone", "grace"),
    [
        (timedelta(hours=24), timedelta(0), timedelta(hours=1)),
        (timedelta(hours=24), timedelta(days=2), timedelta(0)),
        (timedelta(minutes=30), timedelta(hours=6), timedelta(minutes=5)),
    ],
)
def test_the_last_record_of_a_partition_is_found_until_the_plan_drops_it(
    db: None, max_ttl: timedelta, gone: timedelta, grace: timedelta
) -> None:
    """On the real table and the real claim function: up to the last moment the claim finds
    a partition's last record (replay or 410), the plan keeps the partition; once the plan
    drops it, the claim calls the key new."""
    day = today() - timedelta(days=40)
    make_partitions(day)
    created = day_bounds(day)[1] - timedelta(microseconds=1)
    insert_record(created, max_ttl)
    keep_for = max_ttl + gone + grace
    last_found = created + max_ttl + gone - timedelta(microseconds=1)
    dropped_at = day_bounds(day)[1] + keep_for

    def claim(now: datetime) -> str:
        rows = execute(
            "SELECT outcome FROM django_idempotency_claim(1, 'scope', 'k', %s, %s, 0, %s)",
            [max_ttl + gone, gone, now],
        )
        return str(rows[0][0])

    def drops(now: datetime) -> bool:
        found = catalog.list_partitions(connection, RECORDS)
        return partition_name(day) in names(plan_for(found, now=now, keep_for=keep_for).drop)

    assert claim(last_found) in ("found", "expired")
    assert not drops(last_found)
    assert not drops(dropped_at - timedelta(microseconds=1))
    assert drops(dropped_at)
    assert claim(dropped_at) not in ("found", "expired")


def test_plan_is_the_same_whatever_time_zone(database_clock: datetime) -> None:
    found = catalog.list_partitions(connection, RECORDS)
    now = database_clock
    expected = plan_for(found, now=now, ahead=9)
    for zone in ("Pacific/Kiritimati", "Pacific/Pago_Pago", "Europe/Berlin"):
        with override_settings(TIME_ZONE=zone):
            execute("SET LOCAL TIME ZONE %s", [zone])
            local_now = read_database_clock(connection)  # the real one, not the frozen
            plan = plan_for(catalog.list_partitions(connection, RECORDS), now=now, ahead=9)
        assert plan == expected
        assert abs(local_now - now) < timedelta(minutes=5)
    assert expected.create == tuple(now.date() + timedelta(days=n) for n in (8, 9))


def test_plan_lines_say_what_and_why() -> None:
    day = NOW.date()
    plan = plan_for([ours(day - timedelta(days=4)), ours(day)], ahead=1)
    text = "\n".join(plan.lines())
    assert text.startswith(f"{TABLE}: now 2026-11-22 10:30 UTC")
    assert f"create           {partition_name(day + timedelta(days=1))}" in text
    assert f"detach and drop  {partition_name(day - timedelta(days=4))}" in text
    assert f"keep             {partition_name(day)}  (current)" in text
    assert plan_for([ours(day), ours(day + timedelta(days=1))], ahead=1).lines()[-1] == (
        "  nothing to do"
    )


# Creating ------------------------------------------------------------------------------


def test_concurrent_creators_make_each_partition_once(partition_sandbox: None) -> None:
    day = today() + timedelta(days=1)
    detach_and_drop(day)
    barrier = threading.Barrier(8)
    results: list[bool] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            barrier.wait()
            own = connections["default"]
            results.append(
                apply.create_partition(own, RECORDS, day, retry_for=timedelta(seconds=10))
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(results) == [False] * 7 + [True]
    assert table_states()[partition_name(day)] == (True, catalog.PARTITION_COMMENT)


def test_creating_refuses_a_table_of_the_same_name_that_is_not_a_partition(
    partition_sandbox: None,
) -> None:
    day = today() + timedelta(days=1)
    detach_and_drop(day)
    execute(f'CREATE TABLE "{partition_name(day)}" (note text)')
    with pytest.raises(apply.PartitionConflict, match="not a partition"):
        apply.create_partition(connection, RECORDS, day, retry_for=timedelta(0))
    assert execute(f'SELECT count(*) FROM "{partition_name(day)}"') == [(0,)]


# The request path ----------------------------------------------------------------------


@pytest.mark.urls("tests.support.urls")
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_a_request_without_todays_partition_is_503_and_runs_no_ddl(
    partition_sandbox: None, client: Any, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """CONTRACT 10, issue 8: the request path never creates a partition; it fails closed
    and says so loudly, and the check and maintenance put things right."""
    # Tomorrow's too: the request is stamped by the database's own clock, which may have
    # passed midnight since the test began.
    detach_and_drop(today(), today() + timedelta(days=1))
    before = table_states()
    script = ScriptFactory()
    with caplog.at_level(logging.WARNING):
        response = send(client, "POST", path, script, key=new_key())
    assert response.status_code == 503
    assert problem(response)["type"].endswith("store-unavailable")
    assert table_states() == before  # no partition was made
    assert business_rows(script["tag"]) == 0
    assert [r for r in caplog.records if r.levelno >= logging.CRITICAL], caplog.text


def test_covered_until_stops_at_a_gap_and_at_now_when_nothing_holds_now() -> None:
    day = timedelta(days=1)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    parts = [
        catalog.Partition(f"p{n}", base + n * day, base + (n + 1) * day, None) for n in (0, 1, 2, 4)
    ]
    assert catalog.covered_until(parts, base + day / 2) == base + 3 * day
    assert catalog.covered_until(parts, base + 3 * day + day / 2) == base + 3 * day + day / 2
    detached = [catalog.Partition("p1", base, base + day, None, attached=False)]
    assert catalog.covered_until(detached, base) == base
