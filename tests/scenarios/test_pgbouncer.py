"""PgBouncer in transaction pooling mode between the app servers and PostgreSQL.

``live_pgbouncer`` is gunicorn (2 workers x 4 threads: 8 client connections) whose database
connections go through a private PgBouncer with 4 server connections, so consecutive
transactions of one Django connection run on different server connections. Nothing of the
claim may outlive its transaction: the advisory lock is transaction-scoped, the lock wait is
``set_config(..., true)``, and the test project disables server-side cursors and pins
prepared statements off (``DATABASE_POOLING=transaction``; Django's psycopg 3 backend prepares
none unless ``OPTIONS`` asks for them).
The end-to-end tests run through it unchanged.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.conftest import TokenUser
from tests.scenarios import test_e2e_payments as e2e
from tests.support import servers
from tests.support.payments import CHARGE, post, records
from tests.support.servers import PgBouncer


@pytest.fixture
def alice(live_user: TokenUser) -> TokenUser:
    return live_user


def transactions(bouncer: PgBouncer, database: str) -> int:
    stats = {row["database"]: row for row in bouncer.show("STATS")}
    return int(stats[database]["total_xact_count"]) if database in stats else 0


def test_requests_run_through_pgbouncer_in_transaction_mode(
    pgbouncer: PgBouncer, live_pgbouncer: str, test_database_url: str, alice: Any
) -> None:
    database = test_database_url.rsplit("/", 1)[1]
    config = {row["key"]: row["value"] for row in pgbouncer.show("CONFIG")}
    before = transactions(pgbouncer, database)
    key = str(uuid.uuid4())

    # Sequential requests spread over the 8 client connections, whose transactions take
    # turns on the 4 server connections.
    answers = [post(live_pgbouncer, alice, key, CHARGE) for _ in range(40)]

    assert config["pool_mode"] == "transaction"
    assert [a.status_code for a in answers] == [201] * 40
    assert {a.content for a in answers} == {answers[0].content}
    assert post(live_pgbouncer, alice, key, {**CHARGE, "amount": 1}).status_code == 422
    assert transactions(pgbouncer, database) - before >= 40
    pools = [row for row in pgbouncer.show("POOLS") if row["database"] == database]
    assert pools, "no pool for the test database: the server did not go through PgBouncer"
    assert sum(row["sv_active"] + row["sv_idle"] + row["sv_used"] for row in pools) <= 4
    assert records(key) == 1


@pytest.mark.parametrize("delay_ms", [0, 2500], ids=["fast", "slow"])
def test_parallel_identical_requests_execute_once(
    request: pytest.FixtureRequest, alice: Any, delay_ms: int
) -> None:
    e2e.test_parallel_identical_requests_execute_once(
        request, alice, server="live_pgbouncer", clients=20, delay_ms=delay_ms
    )


@pytest.mark.parametrize(("fail", "path"), [("after_write", "/api/charges/")])
def test_failed_first_attempt_commits_nothing_and_frees_the_key(
    live_pgbouncer: str, alice: Any, fail: str, path: str
) -> None:
    e2e.test_failed_first_attempt_commits_nothing_and_frees_the_key(
        live_pgbouncer, alice, fail, path
    )


def test_worker_killed_after_its_write_leaves_nothing_and_the_retry_executes_once(
    live_pgbouncer: str, alice: Any
) -> None:
    e2e.test_worker_killed_after_its_write_leaves_nothing_and_the_retry_executes_once(
        live_pgbouncer, alice, "/api/charges/"
    )


def test_duplicate_waiting_on_a_first_attempt_that_rolls_back_executes_itself(
    live_pgbouncer: str, alice: Any
) -> None:
    e2e.test_duplicate_waiting_on_a_first_attempt_that_rolls_back_executes_itself(
        live_pgbouncer, alice
    )


def test_without_pgbouncer_and_without_root_the_reason_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(servers.shutil, "which", lambda *args, **kwargs: None)
    monkeypatch.setattr(servers.os, "geteuid", lambda: 1000)

    with pytest.raises(LookupError, match=r"pgbouncer is not installed \(Debian: apt-get"):
        servers.find_pgbouncer()
