"""Partition naming, listing and planning, and creating partitions from the request path.

Tests that leave DDL committed (``transaction=True``) use ``partition_sandbox``, which puts
the partitions back as the migration made them; other modules import it from here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency import partitions, signals
from django_idempotency.partitions import Partition, day_bounds, make_plan, partition_name

TABLE = partitions.TABLE


def execute(sql: str, params: list[Any] | None = None, using: str = "default") -> list[Any]:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def table_names() -> set[str]:
    """Every table named like a partition, attached or not."""
    return set(table_states())


def table_states() -> dict[str, tuple[bool, str | None]]:
    """Name: (attached, comment) of every table named like a partition."""
    rows = execute(
        "SELECT relname, relispartition, obj_description(oid, 'pg_class') FROM pg_class "
        "WHERE relkind = 'r' AND relname LIKE %s",
        [TABLE.replace("_", r"\_") + r"\_p%"],
    )
    return {name: (attached, comment) for name, attached, comment in rows}


def attach_foreign(name: str, start: datetime, end: datetime) -> None:
    """A partition someone else made: same name pattern, no comment of ours."""
    execute(f'CREATE TABLE "{name}" (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)')
    execute(
        f'ALTER TABLE {TABLE} ATTACH PARTITION "{name}" '
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )


def insert_record(created_at: datetime, ttl: timedelta, key: str = "k") -> None:
    execute(
        f"INSERT INTO {TABLE} (scope, key, method, path, fingerprint, status, created_at, "
        "expires_at) VALUES ('scope', %s, 'POST', '/p', '{}', 1, %s, %s)",
        [key, created_at, created_at + ttl],
    )


def today() -> date:
    return partitions.database_now(connection).date()


@pytest.fixture
def partition_sandbox(transactional_db: None) -> Iterator[None]:
    """Give back, after a test that commits DDL, the partitions the test started with."""
    before = table_states()
    yield
    for conn in connections.all():
        conn.close()  # a connection left in a transaction would block the DDL below
    execute("SET lock_timeout = '10s'")
    for p in partitions.list_partitions(connection):
        if p.detach_pending:
            execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{p.name}" FINALIZE')
    for name, state in sorted(table_states().items()):
        if before.get(name) != state:
            attached, _ = state
            if attached:
                execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{name}"')
            execute(f'DROP TABLE "{name}"')
    missing = sorted(set(before) - table_names())
    restored = partitions.create_partitions(
        connection, [d for d in map(partitions.partition_day, missing) if d is not None]
    )
    execute("RESET lock_timeout")
    assert sorted(restored) == missing
    assert table_states() == before


# Naming --------------------------------------------------------------------------------


def test_partitions_are_named_and_bounded_by_utc_day() -> None:
    day = date(2026, 3, 29)  # a DST change in Europe: UTC days are still 24 hours
    assert partition_name(day) == "django_idempotency_record_p20260329"
    assert partitions.partition_day(partition_name(day)) == day
    start, end = day_bounds(day)
    assert start == datetime(2026, 3, 29, tzinfo=UTC)
    assert end - start == timedelta(days=1)
    assert partitions.partition_day("django_idempotency_record_p20261399") is None
    assert partitions.partition_day("other_p20261122") is None


# Listing -------------------------------------------------------------------------------


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kolkata", "America/St_Johns", "Pacific/Kiritimati"])
def test_listing_reads_bounds_in_utc_whatever_the_session_time_zone(db: None, zone: str) -> None:
    execute("SET LOCAL TIME ZONE %s", [zone])
    found = partitions.list_partitions(connection)
    assert len(found) >= 6  # yesterday to today + 4, made by the migration
    for p in found:
        day = partitions.partition_day(p.name)
        assert day is not None
        assert (p.lower, p.upper) == day_bounds(day)
        assert p.ours and p.live and not p.default
    assert partitions.database_now(connection).tzinfo == UTC


def test_listing_tells_foreign_default_and_unbounded_partitions_apart(db: None) -> None:
    attach_foreign(
        f"{TABLE}_p20200101", datetime(2020, 1, 1, tzinfo=UTC), datetime(2020, 1, 2, tzinfo=UTC)
    )
    execute(
        f"CREATE TABLE {TABLE}_old PARTITION OF {TABLE} "
        "FOR VALUES FROM (MINVALUE) TO ('2019-01-01 00:00+00')"
    )
    execute(f"CREATE TABLE {TABLE}_rest PARTITION OF {TABLE} DEFAULT")
    found = {p.name: p for p in partitions.list_partitions(connection)}
    foreign = found[f"{TABLE}_p20200101"]
    assert not foreign.ours and foreign.lower == datetime(2020, 1, 1, tzinfo=UTC)
    old = found[f"{TABLE}_old"]
    assert old.lower is None and old.upper == datetime(2019, 1, 1, tzinfo=UTC)
    rest = found[f"{TABLE}_rest"]
    assert rest.default and rest.lower is None and rest.upper is None


def test_table_kind(db: None) -> None:
    assert partitions.table_kind(connection) == "partitioned"
    execute(f"ALTER TABLE {TABLE} RENAME TO moved_away")
    assert partitions.table_kind(connection) is None
    execute(f"CREATE TABLE {TABLE} (id bigint)")
    assert partitions.table_kind(connection) == "plain"


# Planning ------------------------------------------------------------------------------

NOW = datetime(2026, 11, 22, 10, 30, tzinfo=UTC)


def ours(day: date, **fields: Any) -> Partition:
    lower, upper = day_bounds(day)
    return Partition(partition_name(day), lower, upper, partitions.PARTITION_COMMENT, **fields)


def plan_for(found: list[Partition], *, now: datetime = NOW, **options: Any) -> partitions.Plan:
    options = {"ahead": 4, "keep_for": timedelta(hours=25), "drop": True, **options}
    return make_plan(found, now=now, **options)


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
    assert kept[partition_name(day - timedelta(days=1))].startswith("holds records until")
    assert kept[partition_name(day)] == "current"
    assert kept[partition_name(day + timedelta(days=1))] == "future"


def test_plan_never_drops_foreign_default_unbounded_or_current_partitions() -> None:
    day = NOW.date()
    lower, upper = day_bounds(day - timedelta(days=9))
    foreign = Partition(partition_name(day - timedelta(days=9)), lower, upper, None)
    edited = Partition("x", lower, upper, "kept by the DBA")
    unbounded = Partition("old", None, lower, partitions.PARTITION_COMMENT)
    default = Partition("rest", None, None, partitions.PARTITION_COMMENT, default=True)
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
        partition_name(day), *day_bounds(day), partitions.DROPPING_COMMENT, attached=False
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
    partitions.create_partitions(connection, [day])
    created = day_bounds(day)[1] - timedelta(microseconds=1)
    insert_record(created, max_ttl)
    keep_for = max_ttl + gone + grace
    last_found = created + max_ttl + gone - timedelta(microseconds=1)
    dropped_at = day_bounds(day)[1] + keep_for

    def claim(now: datetime) -> str:
        rows = execute(
            "SELECT outcome FROM django_idempotency_claim('scope', 'k', %s, %s, 0, %s)",
            [max_ttl + gone, gone, now],
        )
        return str(rows[0][0])

    def drops(now: datetime) -> bool:
        plan = plan_for(partitions.list_partitions(connection), now=now, keep_for=keep_for)
        return partition_name(day) in names(plan.drop)

    assert claim(last_found) in ("found", "expired")
    assert not drops(last_found)
    assert not drops(dropped_at - timedelta(microseconds=1))
    assert drops(dropped_at)
    assert claim(dropped_at) not in ("found", "expired")


def test_plan_is_the_same_whatever_time_zone(db: None) -> None:
    found = partitions.list_partitions(connection)
    now = partitions.database_now(connection)
    expected = make_plan(found, now=now, ahead=7, keep_for=timedelta(hours=25), drop=True)
    for zone in ("Pacific/Kiritimati", "Pacific/Pago_Pago", "Europe/Berlin"):
        with override_settings(TIME_ZONE=zone):
            execute("SET LOCAL TIME ZONE %s", [zone])
            local_now = partitions.database_now(connection)
            plan = make_plan(
                partitions.list_partitions(connection),
                now=now,
                ahead=7,
                keep_for=timedelta(hours=25),
                drop=True,
            )
        assert plan == expected
        assert abs(local_now - now) < timedelta(minutes=5)
    assert expected.create == tuple(now.date() + timedelta(days=n) for n in (5, 6, 7))


def test_plan_lines_say_what_and_why() -> None:
    day = NOW.date()
    plan = plan_for([ours(day - timedelta(days=4)), ours(day)], ahead=1)
    text = "\n".join(plan.lines())
    assert f"create           {partition_name(day + timedelta(days=1))}" in text
    assert f"detach and drop  {partition_name(day - timedelta(days=4))}" in text
    assert f"keep             {partition_name(day)}  (current)" in text
    assert plan_for([ours(day), ours(day + timedelta(days=1))], ahead=1).lines()[-1] == (
        "  nothing to do"
    )


# The request path ----------------------------------------------------------------------


def detach_and_drop(*days: date) -> None:
    for day in days:
        execute(f'ALTER TABLE {TABLE} DETACH PARTITION "{partition_name(day)}"')
        execute(f'DROP TABLE "{partition_name(day)}"')


@pytest.fixture
def created_signals() -> Iterator[list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        sent.append(kwargs)

    signals.partitions_created.connect(receiver)
    yield sent
    signals.partitions_created.disconnect(receiver)


@pytest.mark.parametrize("in_transaction", [False, True])
def test_ensure_current_partition_creates_today_and_tomorrow(
    partition_sandbox: None,
    created_signals: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
    in_transaction: bool,
) -> None:
    day = today()
    detach_and_drop(day, day + timedelta(days=1))
    if in_transaction:
        # As under ATOMIC_REQUESTS: the DDL must not wait for (or roll back with) the request.
        with transaction.atomic():
            created = partitions.ensure_current_partition(connection)
    else:
        created = partitions.ensure_current_partition(connection)
    assert created == [partition_name(day), partition_name(day + timedelta(days=1))]
    live = {p.name for p in partitions.list_partitions(connection) if p.live and p.ours}
    assert set(created) <= live
    assert created_signals == [
        {"signal": signals.partitions_created, "names": created, "using": "default"}
    ]
    assert [r.levelname for r in caplog.records if r.name == partitions.logger.name] == ["ERROR"]
    assert partitions.ensure_current_partition(connection) == []


def test_concurrent_requests_create_each_partition_once(partition_sandbox: None) -> None:
    day = today()
    detach_and_drop(day, day + timedelta(days=1))
    barrier = threading.Barrier(8)
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def request() -> None:
        try:
            barrier.wait()
            results.append(partitions.ensure_current_partition(connections["default"]))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=request) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    made = sorted(name for created in results for name in created)
    assert made == [partition_name(day), partition_name(day + timedelta(days=1))]


def test_creating_refuses_a_table_of_the_same_name_that_is_not_a_partition(
    partition_sandbox: None,
) -> None:
    day = today() + timedelta(days=1)
    detach_and_drop(day)
    execute(f'CREATE TABLE "{partition_name(day)}" (note text)')
    with pytest.raises(partitions.PartitionConflict, match="not a partition"):
        partitions.create_partition(connection, day, retry_for=timedelta(0))
    assert execute(f'SELECT count(*) FROM "{partition_name(day)}"') == [(0,)]


def test_an_error_on_the_side_connection_reaches_the_caller(partition_sandbox: None) -> None:
    day = today()
    detach_and_drop(day)
    execute(f'CREATE TABLE "{partition_name(day)}" (note text)')
    with transaction.atomic(), pytest.raises(partitions.PartitionConflict):
        partitions.ensure_current_partition(connection)
