"""A streaming replica that the project's router uses for reads, with replication lag injected.

A private primary (Debian's PostgreSQL binaries, ``wal_level = replica``) and a replica made
from it with ``pg_basebackup -R``; gunicorn runs the test project with ``DATABASE_URL`` on the
primary and ``REPLICA_DATABASE_URL`` on the replica, where ``testproject.routers.ReplicaRouter``
sends every read. While the replica's replay is paused (``pg_wal_replay_pause()``), nothing
committed on the primary is visible there: a claim or a replay that read the replica would
execute a retry a second time. The engine reads and writes records on
``router.db_for_write(IdempotencyRecord)`` only, so retries are still replayed.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import requests
from psycopg import sql

from django_idempotency.probe.facts import Fact, replication
from tests.conftest import GunicornServer
from tests.support.chain_processes import wait_for
from tests.support.client import honouring_retry_after, replayed
from tests.support.payments import CHARGE, send_at_once
from tests.support.servers import (
    PostgresCluster,
    migrate,
    postgres_bin,
    primary_and_replica,
    token_user,
)

DATABASE = "payments"


@dataclass(frozen=True)
class ReplicatedApp:
    url: str
    primary: PostgresCluster
    replica: PostgresCluster
    headers: dict[str, str]
    user_id: int

    def post(
        self, key: str, body: dict[str, Any], path: str = "/api/charges/", **headers: str
    ) -> requests.Response:
        return requests.post(
            self.url + path,
            json=body,
            headers={**self.headers, "Idempotency-Key": key, **headers},
            timeout=30,
        )

    def scalar(self, cluster: PostgresCluster, query: str, *params: Any) -> int:
        with cluster.connect(DATABASE) as conn:
            row = conn.execute(query, params).fetchone()
        assert row is not None
        return int(row[0])

    def charges(self, cluster: PostgresCluster) -> int:
        return self.scalar(
            cluster, "SELECT count(*) FROM payments_charge WHERE user_id = %s", self.user_id
        )

    def records(self, cluster: PostgresCluster, key: str) -> int:
        return self.scalar(
            cluster, "SELECT count(*) FROM django_idempotency_record WHERE key = %s", key
        )

    def executions(self) -> int:
        """Runs of the charge handler, rolled back ones included (a sequence on the primary)."""
        return self.scalar(
            self.primary,
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM payments_charge_executions",
        )

    def wait_for_replica(self, timeout: float = 30) -> None:
        """Until the replica has replayed everything the primary has written so far."""
        # The insert position, not the write position: with synchronous_commit off, a
        # commit may not be written out yet when this runs.
        with self.primary.connect() as conn:
            row = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        assert row is not None
        with self.replica.connect() as conn:
            deadline = time.monotonic() + timeout
            while True:
                caught_up = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [row[0]]
                ).fetchone()
                if caught_up and caught_up[0]:
                    return
                assert time.monotonic() < deadline, "the replica did not catch up"
                time.sleep(0.05)

    @contextlib.contextmanager
    def synchronous_standby_names(self, names: str) -> Iterator[None]:
        """Inside the block the primary names ``names`` its synchronous standbys (``*``: the
        replica), as the probe's sessions see. Nothing may commit on the primary meanwhile
        when no standby answers to the name: it would wait for one."""
        self.configure(names)
        try:
            if names == "*":
                query = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
                wait_for(lambda: self.scalar(self.primary, query), timeout=30)
            yield
        finally:
            self.configure(None)

    def configure(self, names: str | None) -> None:
        """Set (None: reset) the primary's synchronous_standby_names, until a new session
        sees it."""
        statement = sql.SQL("ALTER SYSTEM RESET synchronous_standby_names")
        if names is not None:
            statement = sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(names)
        with self.primary.connect() as conn:
            conn.execute(statement)
            conn.execute("SELECT pg_reload_conf()")
        query = "SELECT count(*) FROM pg_settings WHERE name = %s AND setting = %s"
        setting = ("synchronous_standby_names", names or "")
        wait_for(lambda: self.scalar(self.primary, query, *setting), timeout=30)

    @contextlib.contextmanager
    def lagging(self) -> Iterator[None]:
        """Inside the block the replica applies nothing the primary commits."""
        with self.replica.connect() as conn:
            conn.execute("SELECT pg_wal_replay_pause()")
            while True:
                state = conn.execute("SELECT pg_get_wal_replay_pause_state()").fetchone()
                if state and state[0] == "paused":
                    break
                time.sleep(0.02)
            try:
                yield
            finally:
                conn.execute("SELECT pg_wal_replay_resume()")
        self.wait_for_replica()


@pytest.fixture(scope="module")
def app(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
    subprocess_env: dict[str, str],
) -> Iterator[ReplicatedApp]:
    try:
        postgres_bin()
    except LookupError as exc:
        pytest.skip(f"cannot make a replica: {exc}")
    with primary_and_replica() as (primary, replica):
        with primary.connect() as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        migrate({**subprocess_env, "DATABASE_URL": primary.url(DATABASE)})
        token, user_id = token_user(primary, DATABASE)
        env = {
            "DATABASE_URL": primary.url(DATABASE),
            "REPLICA_DATABASE_URL": replica.url(DATABASE),
        }
        with gunicorn_server(workers=2, threads=4, env=env) as server:
            app = ReplicatedApp(
                server.url, primary, replica, {"Authorization": f"Token {token}"}, user_id
            )
            # The token must be on the replica before lag starts: authentication reads it there.
            app.wait_for_replica()
            yield app


def test_reads_go_to_the_replica_which_lags_while_replay_is_paused(app: ReplicatedApp) -> None:
    key = str(uuid.uuid4())
    with app.lagging():
        created = app.post(key, CHARGE)
        through_router = requests.get(app.url + "/api/charges/count/", timeout=10).json()
        on_replica, on_primary = app.charges(app.replica), app.charges(app.primary)
    after_catch_up = requests.get(app.url + "/api/charges/count/", timeout=10).json()

    assert created.status_code == 201, created.text
    # The count view's ORM read went to the replica, which had not applied the charge yet.
    assert through_router["rows"] == on_replica == on_primary - 1
    assert after_catch_up["rows"] == on_primary


@pytest.mark.parametrize("path", ["/api/charges/", "/api/charges-django/", "/api/charges/async/"])
def test_retry_right_after_the_first_commit_is_replayed_not_executed(
    app: ReplicatedApp, path: str
) -> None:
    key = str(uuid.uuid4())
    before = (app.executions(), app.charges(app.primary))
    with app.lagging():
        first = app.post(key, CHARGE, path)
        retries = [app.post(key, CHARGE, path) for _ in range(5)]
        reused = app.post(key, {**CHARGE, "amount": 1}, path)
        lagging_replica = (app.records(app.replica, key), app.charges(app.replica))

    assert (first.status_code, replayed(first)) == (201, False), first.text
    assert [(r.status_code, replayed(r), r.content) for r in retries] == [
        (201, True, first.content)
    ] * 5
    assert reused.status_code == 422
    # The replica had seen neither the record nor the charge while the retries were served.
    assert lagging_replica == (0, before[1])
    assert (app.executions(), app.charges(app.primary)) == (before[0] + 1, before[1] + 1)
    assert app.records(app.primary, key) == 1


@pytest.mark.parametrize("delay_ms", [0, 2500], ids=["fast", "slow"])
def test_parallel_identical_requests_execute_once_while_the_replica_lags(
    app: ReplicatedApp, delay_ms: int
) -> None:
    key = str(uuid.uuid4())
    body = {**CHARGE, "delay_ms": delay_ms}
    before = (app.executions(), app.charges(app.primary))
    with app.lagging():
        answers = send_at_once([partial(app.post, key, body)] * 20)
        retry = app.post(key, body)

    statuses = Counter((a.status_code, replayed(a)) for a in answers)
    assert set(statuses) <= {(201, False), (201, True), (409, False)}, statuses
    assert statuses[(201, False)] == 1, statuses
    created = next(a for a in answers if a.status_code == 201 and not replayed(a))
    assert (retry.status_code, replayed(retry), retry.content) == (201, True, created.content)
    assert (app.executions(), app.charges(app.primary)) == (before[0] + 1, before[1] + 1)
    assert app.records(app.primary, key) == 1


@pytest.mark.parametrize("fault", ["fail_once", "crash_once"])
def test_failed_first_attempt_then_retry_executes_once_while_the_replica_lags(
    app: ReplicatedApp, fault: str
) -> None:
    key = str(uuid.uuid4())
    body = {**CHARGE, fault: str(uuid.uuid4())}
    before = (app.executions(), app.charges(app.primary))
    with app.lagging():
        try:
            failed: int | None = app.post(key, body).status_code
        except requests.ConnectionError:  # crash_once: the worker died mid-request
            failed = None
        records_after_failure = app.records(app.primary, key)
        retry = honouring_retry_after(lambda: app.post(key, body))
        replay = app.post(key, body)

    assert failed == (500 if fault == "fail_once" else None)
    assert records_after_failure == 0
    assert (retry.status_code, replayed(retry)) == (201, False), retry.text
    assert (replay.status_code, replayed(replay), replay.content) == (201, True, retry.content)
    assert (app.executions(), app.charges(app.primary)) == (before[0] + 2, before[1] + 1)
    assert app.records(app.primary, key) == 1


def test_the_probe_reports_the_replica_as_asynchronous(
    app: ReplicatedApp, django_db_blocker: Any
) -> None:
    fact = probe(app, django_db_blocker)
    assert fact.verdict == "warn"
    assert fact.value.startswith("asynchronous (1 standbys"), fact
    assert "can lose the last commits" in fact.detail


def probe(
    app: ReplicatedApp,
    django_db_blocker: Any,
    *,
    names: str | None = None,
    commit: str | None = None,
    user: str = "postgres",
) -> Fact:
    """The probe's replication line on the primary, with ``names`` its synchronous standbys
    and, in the probe's session, ``synchronous_commit = commit``; as ``user``."""
    with contextlib.ExitStack() as stack:
        if names is not None:
            stack.enter_context(app.synchronous_standby_names(names))
        stack.enter_context(django_db_blocker.unblock())
        connection = stack.enter_context(app.primary.django_connection(DATABASE, user))
        if commit is not None:
            with connection.cursor() as cursor:
                cursor.execute(f"SET synchronous_commit = {commit}")
        return replication(connection)


EVERY_ANSWERED_COMMIT = "a promoted synchronous standby has every commit that was answered"


@pytest.mark.parametrize(
    ("commit", "verdict", "value", "detail"),
    [
        (
            "on",
            "pass",
            "synchronous (1 of 1 standbys, synchronous_commit on)",
            EVERY_ANSWERED_COMMIT,
        ),
        (
            "remote_apply",
            "pass",
            "synchronous (1 of 1 standbys, synchronous_commit remote_apply)",
            EVERY_ANSWERED_COMMIT,
        ),
        # Written to the standby's OS, not flushed: a failover to it loses nothing unless
        # its OS crashed with the primary's (docs/deployment.md, "Failover").
        (
            "remote_write",
            "pass",
            "synchronous (1 of 1 standbys, synchronous_commit remote_write)",
            "unless its OS crashed with the primary's",
        ),
        # The standby is synchronous, but this session's commits do not wait for it.
        ("local", "warn", "asynchronous (1 standbys, synchronous_commit local)", "can lose"),
    ],
)
def test_the_probe_reports_a_synchronous_standby_by_what_the_session_s_commits_wait_for(
    app: ReplicatedApp, django_db_blocker: Any, commit: str, verdict: str, value: str, detail: str
) -> None:
    fact = probe(app, django_db_blocker, names="*", commit=commit)
    assert (fact.verdict, fact.value) == (verdict, value)
    assert detail in fact.detail


def test_the_probe_warns_of_a_synchronous_standby_named_and_none_connected(
    app: ReplicatedApp, django_db_blocker: Any
) -> None:
    # The replica streams, but under another name: every commit would wait for "nobody".
    fact = probe(app, django_db_blocker, names="nobody")
    assert (fact.verdict, fact.value) == (
        "warn",
        "synchronous_standby_names is 'nobody', and no synchronous standby is connected",
    )
    assert "requests hang" in fact.detail


def test_the_probe_says_when_its_role_cannot_see_the_standbys_state(
    app: ReplicatedApp, django_db_blocker: Any
) -> None:
    # A role without pg_monitor (or pg_read_all_stats) sees the standbys' rows, not their state.
    with app.primary.connect(DATABASE) as conn:
        conn.execute("DROP ROLE IF EXISTS watcher")
        conn.execute("CREATE ROLE watcher LOGIN")
    fact = probe(app, django_db_blocker, user="watcher")
    assert (fact.verdict, fact.value) == ("info", "1 standbys, their state hidden from this role")
    assert "pg_monitor" in fact.detail
