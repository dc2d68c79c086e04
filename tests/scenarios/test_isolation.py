"""Over HTTP, a database whose transactions start at REPEATABLE READ or SERIALIZABLE: the claim
refuses to run, whatever set the level, so no key runs twice.

At those levels a transaction's snapshot is taken by its first statement, before the claim
holds the key's lock: a duplicate that waited for the lock does not see the record that the
first request committed meanwhile, and would charge again (REPEATABLE READ committed 4
charges for one key and 5 duplicates; SERIALIZABLE ran the charge again and failed at the
commit). Each server below is gunicorn (2 workers x 4 threads) serving the payments API:

- ``alter-database``: a private database of the test's own, migrated, then
  ``ALTER DATABASE ... SET default_transaction_isolation = 'repeatable read'``;
- ``options``: the test database, through libpq ``options`` in ``DATABASES`` (the
  ``options`` query parameter of ``DATABASE_URL``), at REPEATABLE READ or SERIALIZABLE.

A slow charge (3 s) holds the key while 5 duplicates wait for it (``Prefer: wait=10``):
every keyed request is answered ``500`` ``misconfigured``, the charge never executes, and
the server logs an error naming the view and the fix.

On the ``ALTER DATABASE`` one, a prefork Celery worker on a private Redis: the exactly-once
ledger task does not run, its message goes back to the broker on every delivery, and once the
database is fixed it runs, once.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
import pytest
import requests
from celery import Celery
from psycopg import sql

from testproject.payments.tasks import POST_LEDGER_ENTRY
from tests.conftest import GunicornServer, TokenUser
from tests.support.chain_processes import CHAIN_SETTINGS, CeleryWorker, RedisServer, wait_for
from tests.support.client import replayed
from tests.support.payments import CHARGE, counts, post, send_at_once, start_first
from tests.support.servers import (
    count,
    database_name,
    insert_token_user,
    private_database,
    with_options,
)

# The test database must exist (pytest-django makes it only for such tests); what the servers
# commit there is flushed at the module's end (flush_after_module).
pytestmark = pytest.mark.django_db

SLOW_CHARGE = {**CHARGE, "delay_ms": 3000}
DUPLICATES = 5


@dataclass(frozen=True)
class Deployment:
    """A live server whose database runs at ``level``, a user of it, and that database."""

    server: GunicornServer
    database_url: str
    user: TokenUser
    level: str

    def records(self, key: str) -> int:
        return count(
            self.database_url, "SELECT count(*) FROM django_idempotency_record WHERE key = %s", key
        )


@pytest.fixture(scope="module")
def repeatable_read_database(
    test_database_url: str,
    subprocess_env: dict[str, str],
    cleanup_in_background: Callable[[Callable[[], object]], None],
) -> Iterator[str]:
    """A private database whose default isolation is REPEATABLE READ (never the shared
    ones)."""
    with private_database(
        test_database_url,
        "_repeatable_read",
        lambda url: {**subprocess_env, "DATABASE_URL": url},
        cleanup_in_background,
    ) as url:
        alter_default(url, "SET default_transaction_isolation = 'repeatable read'")
        yield url


def alter_default(url: str, change: str) -> None:
    """``ALTER DATABASE <that of url> <change>``: what new connections to it get."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} ").format(sql.Identifier(database_name(url)))
            + sql.SQL(change)
        )


def repeatable_read_by_alter_database(
    request: pytest.FixtureRequest,
) -> contextlib.AbstractContextManager[Deployment]:
    url: str = request.getfixturevalue("repeatable_read_database")
    return deployed(request, url, url, "REPEATABLE READ")


def by_libpq_options(level: str) -> Callable[[pytest.FixtureRequest], Any]:
    def deploy(request: pytest.FixtureRequest) -> contextlib.AbstractContextManager[Deployment]:
        database_url: str = request.getfixturevalue("test_database_url")
        request.getfixturevalue("flush_after_module")
        # libpq reads a space in an option's value escaped by a backslash.
        value = level.lower().replace(" ", "\\ ")
        url = with_options(database_url, f"-c default_transaction_isolation={value}")
        return deployed(request, url, database_url, level)

    return deploy


@contextlib.contextmanager
def deployed(
    request: pytest.FixtureRequest, url: str, database_url: str, level: str
) -> Iterator[Deployment]:
    """gunicorn (2 workers x 4 threads) on ``url``, and a user of ``database_url``."""
    gunicorn_server = request.getfixturevalue("gunicorn_server")
    user_id, token = insert_token_user(database_url)
    with gunicorn_server(workers=2, threads=4, env={"DATABASE_URL": url}) as server:
        yield Deployment(server, database_url, TokenUser(user_id, token), level)


DEPLOYMENTS = {
    "alter-database-repeatable-read": repeatable_read_by_alter_database,
    "options-repeatable-read": by_libpq_options("REPEATABLE READ"),
    "options-serializable": by_libpq_options("SERIALIZABLE"),
}


@pytest.fixture(scope="module", params=DEPLOYMENTS)
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    with DEPLOYMENTS[request.param](request) as deployment:
        yield deployment


def test_a_slow_charge_and_its_waiting_duplicates_are_refused_and_never_run(
    deployment: Deployment,
) -> None:
    url, user = deployment.server.url, deployment.user
    key = str(uuid.uuid4())
    before = counts(url)

    with ThreadPoolExecutor(1) as pool:
        first = start_first(pool, url, user, key, SLOW_CHARGE, before)
        duplicates = send_at_once(
            [partial(post, url, user, key, SLOW_CHARGE, Prefer="wait=10")] * DUPLICATES
        )
        answers = [first.result(), *duplicates]

    done = counts(url) - before
    print(f"{deployment.level}: answers {[a.status_code for a in answers]}, {done}")
    assert done.rows <= 1  # never two charges, whatever else fails below
    assert done == (0, 0), [a.text for a in answers]
    assert deployment.records(key) == 0
    for answer in answers:
        assert (answer.status_code, replayed(answer)) == (500, False), answer.text
        assert answer.headers["Content-Type"] == "application/problem+json"
        assert answer.json()["type"].endswith("misconfigured"), answer.json()
    log = deployment.server.log_text()
    assert "ChargeCreateView was not run" in log, log[-3000:]
    assert deployment.level in log and "READ COMMITTED" in log


def test_requests_without_a_key_still_run(deployment: Deployment) -> None:
    # Only the claim refuses: the project's other requests are its own business.
    url, user = deployment.server.url, deployment.user
    before = counts(url)
    plain = requests.post(
        url + "/api/charges-plain/", json=CHARGE, headers=user.headers, timeout=30
    )
    assert plain.status_code == 201, plain.text
    assert counts(url) - before == (1, 1)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_an_exactly_once_task_does_not_run_and_its_message_waits_in_the_broker_for_the_fix(
    repeatable_read_database: str, subprocess_env: dict[str, str], private_redis: RedisServer
) -> None:
    url = repeatable_read_database
    user_id, _ = insert_token_user(url)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO payments_charge (amount, currency, user_id, created, description) "
            "VALUES (2499, 'inr', %s, now(), '') RETURNING id",
            [user_id],
        ).fetchone()
    assert row is not None
    charge_id = row[0]
    env = {
        **subprocess_env,
        "DATABASE_URL": url,
        "CELERY_BROKER_URL": private_redis.url,
        "DJANGO_SETTINGS_MODULE": CHAIN_SETTINGS,
    }
    ledger = "SELECT count(*) FROM payments_ledgerentry WHERE message_id = %s"
    message_id = str(uuid.uuid4())
    publisher = Celery(f"isolation-{message_id[:6]}", set_as_current=False)
    publisher.conf.update(broker_url=private_redis.url)

    worker = CeleryWorker(env, concurrency=1)
    try:
        publisher.send_task(POST_LEDGER_ENTRY, (charge_id, 2499, "inr"), task_id=message_id)
        # Delivered, refused and given back, then delivered again: never acknowledged.
        wait_for(lambda: worker.count(f"[{message_id}] received") >= 2, timeout=60)
        assert f"[{message_id}] cannot run at this database's isolation level" in worker.text()
        assert count(url, ledger, message_id) == 0
        assert "task testproject.payments.tasks.post_ledger_entry was not run" in worker.text()
    finally:
        worker.stop()

    # Fixed (new connections run at READ COMMITTED): the message that waited runs, once.
    alter_default(url, "RESET default_transaction_isolation")
    fixed = CeleryWorker(env, concurrency=1)
    try:
        wait_for(lambda: count(url, ledger, message_id), timeout=60)
        time.sleep(1)
        assert count(url, ledger, message_id) == 1
    finally:
        fixed.stop()
        alter_default(url, "SET default_transaction_isolation = 'repeatable read'")
