"""Change data capture, proven on a private cluster with ``wal_level = logical``: events reach
a ``pgoutput`` slot through the package's publication in commit order, as the root table,
rolled-back ones never; dropping an expired partition by partition maintenance, even one
whose rows the slot has not read yet, takes no event from the slot and stops nothing."""

from __future__ import annotations

import contextlib
import json
import secrets
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings

from django_idempotency.messaging.cdc import EVENTS, TABLE, emit_event
from django_idempotency.partitions.catalog import utc_today
from django_idempotency.partitions.maintain import maintain
from tests.support import pgoutput
from tests.support.servers import PostgresCluster, logical_cluster, postgres_bin

PUBLICATION = "django_idempotency_events"
SLOT = "debezium_like"


@contextlib.contextmanager
def _aliases(cluster: PostgresCluster, *aliases: str) -> Iterator[None]:
    """Django databases on ``cluster``: one connection each, as two app processes have."""
    for alias in aliases:
        connections.settings[alias] = {
            **connections.settings["default"],
            "NAME": "postgres",
            "HOST": "127.0.0.1",
            "PORT": str(cluster.port),
            "USER": "postgres",
            "PASSWORD": "",
            "CONN_MAX_AGE": 0,
        }
    try:
        yield
    finally:
        for alias in aliases:
            connections[alias].close()
            del connections[alias]
            del connections.settings[alias]


@pytest.fixture(scope="module")
def cluster(django_db_blocker: Any) -> Iterator[PostgresCluster]:
    """Migrated, with the package's publication (made by its command) and a pgoutput slot."""
    try:
        postgres_bin()
    except LookupError as exc:
        pytest.skip(f"cannot make a private cluster: {exc}")
    with (
        logical_cluster() as cluster,
        _aliases(cluster, "cdc", "cdc_other"),
        django_db_blocker.unblock(),
        override_settings(IDEMPOTENCY_CDC_PUBLICATION=PUBLICATION),
    ):
        call_command("migrate", "django_idempotency", database="cdc", verbosity=0)
        call_command("idempotency_cdc", "--database", "cdc", "publication", stdout=StringIO())
        with cluster.connect() as conn:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [SLOT])
        yield cluster


@pytest.fixture
def on_cluster(cluster: PostgresCluster, django_db_blocker: Any) -> Iterator[PostgresCluster]:
    with django_db_blocker.unblock(), override_settings(IDEMPOTENCY_CDC_PUBLICATION=PUBLICATION):
        yield cluster


def read_slot(cluster: PostgresCluster) -> list[pgoutput.Transaction]:
    """Consume what the slot holds, as a connector would, decoded."""
    with cluster.connect() as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s)",
            [SLOT, PUBLICATION],
        ).fetchall()
    return pgoutput.decode([row[0] for row in rows])


def event_ids(transactions: list[pgoutput.Transaction]) -> list[list[str | None]]:
    return [[insert.values["id"] for insert in t.inserts] for t in transactions]


def insert_dated(cluster: PostgresCluster, created_at: datetime, payload: str) -> str:
    """An event stamped ``created_at`` (emit_event stamps now), committed at once."""
    event_id = str(uuid.uuid4())
    with cluster.connect() as conn:
        conn.execute(
            f"INSERT INTO {TABLE} (id, created_at, aggregatetype, aggregateid, type, payload) "
            "VALUES (%s, %s, 'order', '1', 'OrderArchived', %s)",
            [event_id, created_at, payload],
        )
    return event_id


def root_oid(cluster: PostgresCluster) -> int:
    with cluster.connect() as conn:
        row = conn.execute("SELECT %s::regclass::oid", [TABLE]).fetchone()
    assert row is not None
    return int(row[0])


def test_the_command_made_the_publication_and_status_says_ready(
    on_cluster: PostgresCluster,
) -> None:
    out = StringIO()
    call_command("idempotency_cdc", "--database", "cdc", "status", stdout=out)
    text = out.getvalue()
    assert "wal_level = logical" in text
    assert "inserts of the event table, through its root" in text
    assert f"slot {SLOT} (pgoutput, inactive)" in text
    # Nothing left to do: the command is safe to run again.
    out = StringIO()
    call_command("idempotency_cdc", "--database", "cdc", "publication", "--sql", stdout=out)
    assert out.getvalue().strip() == "-- nothing to do"


def test_events_reach_the_slot_in_commit_order_as_the_root_table_rolled_back_never(
    on_cluster: PostgresCluster,
) -> None:
    read_slot(on_cluster)  # whatever earlier tests left
    # Two app connections interleave: the first to write commits last.
    first = transaction.atomic(using="cdc")
    first.__enter__()
    try:
        a = emit_event("order", 1, "OrderPlaced", {"n": 1}, using="cdc")
        with transaction.atomic(using="cdc_other"):
            b = emit_event("order", 2, "OrderPlaced", {"n": 2}, using="cdc_other")
        with contextlib.suppress(RuntimeError), transaction.atomic(using="cdc"):
            emit_event("order", 1, "OrderNoted", {"undone": "savepoint"}, using="cdc")
            raise RuntimeError("roll the savepoint back")
        c = emit_event("order", 1, "OrderPaid", {"n": 3}, using="cdc")
    finally:
        first.__exit__(None, None, None)
    with contextlib.suppress(RuntimeError), transaction.atomic(using="cdc_other"):
        emit_event("order", 3, "OrderPlaced", {"undone": "transaction"}, using="cdc_other")
        raise RuntimeError("roll the transaction back")
    with transaction.atomic(using="cdc_other"):
        d = emit_event("order", 4, "OrderPlaced", {"n": 4}, using="cdc_other", cloudevents=True)

    got = read_slot(on_cluster)

    assert event_ids(got) == [[b], [a, c], [d]]
    assert [t.commit_lsn for t in got] == sorted(t.commit_lsn for t in got)
    relations = {insert.relation for t in got for insert in t.inserts}
    assert {(r.oid, r.name) for r in relations} == {(root_oid(on_cluster), TABLE)}
    placed = got[0].inserts[0].values
    assert (placed["aggregatetype"], placed["aggregateid"], placed["type"]) == (
        "order",
        "2",
        "OrderPlaced",
    )
    assert placed["payload"] == '{"n": 2}'
    assert '"specversion": "1.0"' in (got[2].inserts[0].values["payload"] or "")


def test_dropping_an_expired_partition_takes_nothing_from_the_slot(
    on_cluster: PostgresCluster,
) -> None:
    read_slot(on_cluster)
    yesterday = utc_today() - timedelta(days=1)
    # Large and random: stored out of line (TOAST), in the partition's own TOAST table.
    large = json.dumps({"blob": secrets.token_hex(64 * 1024)})
    old = insert_dated(on_cluster, datetime(*yesterday.timetuple()[:3], 12, tzinfo=UTC), large)
    with transaction.atomic(using="cdc"):
        before = emit_event("order", 5, "OrderPlaced", {"n": 5}, using="cdc")

    # Nothing read yet: yesterday's partition goes with a row the slot has not sent.
    with override_settings(IDEMPOTENCY_CDC_RETENTION=timedelta.resolution):
        report = maintain("cdc", tables=[EVENTS])
    assert report.dropped == [EVENTS.partition_name(yesterday)]
    with on_cluster.connect() as conn:
        assert conn.execute("SELECT to_regclass(%s)", [report.dropped[0]]).fetchone() == (None,)

    with transaction.atomic(using="cdc"):
        after = emit_event("order", 6, "OrderShipped", {"n": 6}, using="cdc")

    got = read_slot(on_cluster)

    assert event_ids(got) == [[old], [before], [after]]
    assert json.loads(got[0].inserts[0].values["payload"] or "") == json.loads(large)
    assert {i.relation.name for t in got for i in t.inserts} == {TABLE}
    # The slot goes on: the next event arrives on the next read.
    with transaction.atomic(using="cdc"):
        last = emit_event("order", 7, "OrderClosed", {}, using="cdc")
    assert event_ids(read_slot(on_cluster)) == [[last]]
