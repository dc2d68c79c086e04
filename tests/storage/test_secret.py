"""The app's shared secret (storage/secret.py, engine/hashing.py): app servers with different
``SECRET_KEY`` values on one database serialise a key and derive the same downstream keys; a
server whose ``IDEMPOTENCY_SECRET_KEY`` is not the database's is refused at its claims; an
upgrade from servers that locked under another secret serialises through the fallbacks; a
database without the secret refuses, loudly, rather than fall back to ``SECRET_KEY``."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.test import override_settings

from django_idempotency.engine.errors import InProgress, Misconfigured
from django_idempotency.engine.hashing import claim_locks, keyed_lock, lock_id
from django_idempotency.engine.unit import UnitOfWork
from django_idempotency.engine.work import Refuse, Replay, Result, Run, Work
from django_idempotency.storage import records as storage
from django_idempotency.storage import secret
from testproject.payments.models import Charge
from tests.conftest import GunicornServer, TokenUser, run_gunicorn
from tests.support.chain_processes import (
    processor_captures,
    processor_stats,
    run_processor,
    wait_for,
)
from tests.support.claims import store_first, wait_for_lock_waiters

# Two deployments of one project whose SECRET_KEYs differ: a rolling rotation, or a secret
# per pod.
SECRET_KEYS = ("first server's SECRET_KEY, before the rotation", "second server's, after it")


# Two real app servers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor() -> Iterator[str]:
    with run_processor() as url:
        yield url


@pytest.fixture(scope="module")
def servers(
    subprocess_env: dict[str, str], processor: str
) -> Iterator[tuple[GunicornServer, GunicornServer]]:
    env = {**subprocess_env, "PAYMENTS_PROCESSOR_URL": processor}
    with contextlib.ExitStack() as stack:
        first, second = (
            stack.enter_context(run_gunicorn({**env, "DJANGO_SECRET_KEY": key}, workers=1))
            for key in SECRET_KEYS
        )
        yield first, second


def charge(
    server: GunicornServer, user: TokenUser, key: str, *, wait: int | None = None, **body: Any
) -> requests.Response:
    headers = {**user.headers, "Idempotency-Key": key}
    if wait is not None:
        headers["Prefer"] = f"wait={wait}"
    return requests.post(
        f"{server.url}/api/charges/",
        json={"amount": 2499, "currency": "inr", **body},
        headers=headers,
        timeout=60,
    )


def held_claims() -> int:
    """Advisory locks held in the claim's lock space on the test database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = 1768187245 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        (count,) = cursor.fetchone()
    return int(count)


@pytest.mark.timeout(120)
def test_a_duplicate_sent_to_a_server_with_another_secret_key_never_runs_the_charge_again(
    servers: tuple[GunicornServer, GunicornServer], processor: str, live_user: TokenUser
) -> None:
    first, second = servers
    key = str(uuid.uuid4())
    before = processor_stats(processor)["captures"]
    with ThreadPoolExecutor(1) as pool:
        # A slow charge on the first server: it holds the key for 4 s.
        slow = pool.submit(charge, first, live_user, key, delay_ms=4000)
        wait_for(lambda: held_claims() >= 1 or slow.done(), timeout=30)
        assert not slow.done(), slow.result().text
        started = time.monotonic()
        duplicate = charge(second, live_user, key, wait=20, delay_ms=4000)
        waited = time.monotonic() - started
        answered = slow.result()
    print(f"the duplicate answered {duplicate.status_code} after {waited:.2f}s")
    assert answered.status_code == 201, answered.text
    # The second server found the first one's claim: it waited for it and replayed its
    # answer, or (where waiting is not on) told the client to come back. It never ran it.
    if duplicate.status_code == 409:
        assert duplicate.json()["type"].endswith("in-progress"), duplicate.text
    else:
        assert duplicate.status_code == 201, duplicate.text
        assert duplicate.headers.get("Idempotent-Replayed") == "true"
        assert duplicate.json() == answered.json()
    assert Charge.objects.filter(user=live_user.user).count() == 1
    assert processor_stats(processor)["captures"] == before + 1


@pytest.mark.timeout(120)
def test_a_retry_on_a_server_with_another_secret_key_sends_the_same_downstream_key(
    servers: tuple[GunicornServer, GunicornServer], processor: str, live_user: TokenUser
) -> None:
    first, second = servers
    key, body = str(uuid.uuid4()), {"crash_once": uuid.uuid4().hex}
    before = processor_stats(processor)
    # The first server's worker dies after the capture and before its commit: no answer.
    with pytest.raises(requests.ConnectionError):
        charge(first, live_user, key, **body)
    assert processor_stats(processor)["captures"] == before["captures"] + 1
    retried = charge(second, live_user, key, **body)
    assert retried.status_code == 201, retried.text
    after = processor_stats(processor)
    # The processor saw the first server's key again, and answered with the first capture.
    assert after["captures"] == before["captures"] + 1
    assert after["replays"] == before["replays"] + 1
    assert retried.json()["capture"] == processor_captures(processor)[-1]["id"]
    assert Charge.objects.filter(user=live_user.user).count() == 1


# A server whose IDEMPOTENCY_SECRET_KEY is not the database's ------------------------------

OWN_SECRET = "a secret of this server's own, from a vault"


@pytest.fixture(scope="module")
def own_secret_server(subprocess_env: dict[str, str], processor: str) -> Iterator[GunicornServer]:
    env = {**subprocess_env, "PAYMENTS_PROCESSOR_URL": processor}
    with run_gunicorn({**env, "IDEMPOTENCY_SECRET_KEY": OWN_SECRET}, workers=1) as server:
        yield server


def refused_as_misconfigured(response: requests.Response) -> bool:
    return response.status_code == 500 and response.json()["type"].endswith(Misconfigured.name)


@pytest.mark.timeout(120)
def test_a_server_with_a_secret_of_its_own_never_runs_a_key_another_server_is_running(
    servers: tuple[GunicornServer, GunicornServer],
    own_secret_server: GunicornServer,
    processor: str,
    live_user: TokenUser,
) -> None:
    first, _ = servers
    key = str(uuid.uuid4())
    before = processor_stats(processor)["captures"]
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(charge, first, live_user, key, delay_ms=3000)
        wait_for(lambda: held_claims() >= 1 or slow.done(), timeout=30)
        assert not slow.done(), slow.result().text
        # Under a lock of its own the duplicate would run beside the first (2 captures).
        duplicate = charge(own_secret_server, live_user, key, delay_ms=3000)
        answered = slow.result()
    assert answered.status_code == 201, answered.text
    assert refused_as_misconfigured(duplicate), duplicate.text
    # A fresh key is refused too: nothing runs on that server.
    fresh = charge(own_secret_server, live_user, str(uuid.uuid4()))
    assert refused_as_misconfigured(fresh), fresh.text
    assert Charge.objects.filter(user=live_user.user).count() == 1
    assert processor_stats(processor)["captures"] == before + 1


@pytest.mark.timeout(120)
def test_a_retry_never_reaches_the_processor_under_another_downstream_key(
    servers: tuple[GunicornServer, GunicornServer],
    own_secret_server: GunicornServer,
    processor: str,
    live_user: TokenUser,
) -> None:
    first, second = servers
    key, body = str(uuid.uuid4()), {"crash_once": uuid.uuid4().hex}
    before = processor_stats(processor)
    with pytest.raises(requests.ConnectionError):
        charge(first, live_user, key, **body)
    # The retry lands on the server with a secret of its own: refused, nothing captured
    # (its downstream key would have been another, and the processor would capture again).
    refused = charge(own_secret_server, live_user, key, **body)
    assert refused_as_misconfigured(refused), refused.text
    retried = charge(second, live_user, key, **body)
    assert retried.status_code == 201, retried.text
    after = processor_stats(processor)
    assert after["captures"] == before["captures"] + 1
    assert after["replays"] == before["replays"] + 1
    assert Charge.objects.filter(user=live_user.user).count() == 1


def configured(server: tuple[str | None, list[str]]) -> Any:
    key, fallbacks = server
    return override_settings(IDEMPOTENCY_SECRET_KEY=key, IDEMPOTENCY_SECRET_KEY_FALLBACKS=fallbacks)


def work(key: str) -> Work:
    return Work(
        principal="tests:rotation",
        key=key,
        method="POST",
        path="/rotation/",
        fingerprint={"body": "x"},
        ttl=timedelta(hours=1),
    )


@pytest.mark.django_db
def test_a_secret_key_that_is_not_the_databases_is_refused_at_the_claim_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with configured((OWN_SECRET, [])), pytest.raises(Misconfigured):
        UnitOfWork(work(str(uuid.uuid4())), wait=timedelta(0)).open()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("remove IDEMPOTENCY_SECRET_KEY" in m for m in errors), errors


@pytest.mark.django_db
def test_a_secret_key_equal_to_the_databases_is_accepted() -> None:
    with configured((secret.shared_secret(DEFAULT_DB_ALIAS), [])):
        unit = UnitOfWork(work(str(uuid.uuid4())), wait=timedelta(0))
        decision = unit.open()
    assert isinstance(decision, Run)
    unit.fail(RuntimeError("only looking"))


@pytest.mark.django_db
def test_a_secret_changed_in_the_database_is_read_again_before_refusing() -> None:
    # The process read the database's secret before it changed (restored from a backup,
    # say); a server set with the new one is not refused for the stale copy.
    secret.shared_secret(DEFAULT_DB_ALIAS)
    with connection.cursor() as cursor:  # rolled back with the test
        cursor.execute("UPDATE django_idempotency_secret SET secret = %s", [OWN_SECRET])
    try:
        with configured((OWN_SECRET, [])):
            assert claim_locks(DEFAULT_DB_ALIAS, "p", "k")[0] == lock_id(DEFAULT_DB_ALIAS, "p", "k")
            assert secret.shared_secret(DEFAULT_DB_ALIAS) == OWN_SECRET
    finally:
        secret.forget()


# Servers of an older version in flight: IDEMPOTENCY_SECRET_KEY_FALLBACKS -------------------

# The secret that servers of an older version (which keyed the lock with SECRET_KEY or their
# own IDEMPOTENCY_SECRET_KEY) lock keys with while the upgrade rolls out.
OLD = "the secret of the version before"


class Holder(threading.Thread):
    """A unit of work of a server configured as ``server``, on its own connection, that
    claims ``key`` and holds it until ``release`` is set, then stores its answer."""

    def __init__(self, server: tuple[str | None, list[str]], key: str) -> None:
        super().__init__(daemon=True)
        self.server, self.key = server, key
        self.claimed, self.release = threading.Event(), threading.Event()
        self.decision: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            # The settings are the process's: read once here, under this server's own.
            with configured(self.server):
                unit = UnitOfWork(work(self.key), wait=timedelta(0))
                self.decision = unit.open()
            self.claimed.set()
            self.release.wait(30)
            if isinstance(self.decision, Run):
                unit.close(Result(201, [], b"first"))
        except BaseException as exc:
            self.error = exc
        finally:
            self.claimed.set()
            connections.close_all()


@contextlib.contextmanager
def holding(server: tuple[str | None, list[str]], key: str) -> Iterator[Holder]:
    holder = Holder(server, key)
    holder.start()
    assert holder.claimed.wait(30)
    assert holder.error is None and isinstance(holder.decision, Run), holder.error
    try:
        yield holder
    finally:
        holder.release.set()
        holder.join(30)
        assert holder.error is None, holder.error


@contextlib.contextmanager
def held_by_an_older_version(key: str) -> Iterator[None]:
    """The key's lock as a server of the version before takes it: under ``OLD`` alone."""
    lock = keyed_lock(OLD, work(key).principal, key)
    release, taken = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(1768187245, %s)", [lock])
                taken.set()
                release.wait(30)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(hold)
        assert taken.wait(30)
        try:
            yield
        finally:
            release.set()
            holder.result(30)


def open_as(server: tuple[str | None, list[str]], key: str, wait: timedelta = timedelta(0)) -> Any:
    """What a server configured as ``server`` decides for ``key``; rolled back if it runs."""
    with configured(server):
        unit = UnitOfWork(work(key), wait=wait)
        decision = unit.open()
    if isinstance(decision, Run):
        unit.fail(RuntimeError("only looking"))
    return decision


def busy(decision: Any) -> bool:
    return isinstance(decision, Refuse) and isinstance(decision.error, InProgress)


UPGRADING = (None, [OLD])
UPGRADED = (None, [])


@pytest.mark.django_db(transaction=True)
def test_a_server_with_the_fallback_serialises_a_key_with_a_server_of_the_older_version() -> None:
    key = str(uuid.uuid4())
    with held_by_an_older_version(key):
        assert busy(open_as(UPGRADING, key))


@pytest.mark.django_db(transaction=True)
def test_without_the_fallback_an_upgrade_in_flight_does_not_serialise_which_is_why_it_exists() -> (
    None
):
    key = str(uuid.uuid4())
    with held_by_an_older_version(key):
        assert isinstance(open_as(UPGRADED, key), Run)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("holder", "duplicate"),
    [(UPGRADING, UPGRADED), (UPGRADED, UPGRADING)],
    ids=["upgrading-then-upgraded", "upgraded-then-upgrading"],
)
def test_servers_with_and_without_the_fallback_serialise_a_key(
    holder: tuple[str | None, list[str]], duplicate: tuple[str | None, list[str]]
) -> None:
    key = str(uuid.uuid4())
    with holding(holder, key):
        assert busy(open_as(duplicate, key))


@pytest.mark.django_db(transaction=True)
def test_with_fallbacks_a_duplicate_waits_for_the_holder_and_replays() -> None:
    key = str(uuid.uuid4())
    with holding(UPGRADED, key) as holder:
        threading.Timer(0.5, holder.release.set).start()
        decision = open_as(UPGRADING, key, wait=timedelta(seconds=20))
    assert isinstance(decision, Replay) and decision.sent_body() == b"first"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("blocked", ["database", "old"])
def test_servers_with_different_fallbacks_never_deadlock(blocked: str) -> None:
    # Two servers take a key's locks under the database's secret and under OLD (and one of
    # them under a third). A third connection holds one of the shared locks; the first server
    # queues behind it, then the second. Were the locks taken in each server's own order, one
    # of the two runs would end with each server holding the lock the other waits for:
    # PostgreSQL's "deadlock detected". In one order, they run one after the other.
    key, principal = str(uuid.uuid4()), "tests:rotation"
    claims = []
    for server in (UPGRADING, (None, ["another", OLD])):
        with configured(server):  # the settings are the process's: worked out here
            claims.append(claim_locks(DEFAULT_DB_ALIAS, principal, key))
    if blocked == "database":
        held = lock_id(DEFAULT_DB_ALIAS, principal, key)
    else:
        held = keyed_lock(OLD, principal, key)

    def run(lock: int, also: tuple[int, ...]) -> storage.Outcome:
        try:
            with transaction.atomic():
                claimed = storage.claim(
                    DEFAULT_DB_ALIAS, lock=lock, principal=principal, key=key,
                    window=timedelta(hours=1), gone=timedelta(0), wait=timedelta(seconds=20),
                    also_lock=also,
                )  # fmt: skip
                if claimed.outcome is storage.Outcome.WON:
                    store_first(principal, key, claimed, ttl=timedelta(hours=1))
            return claimed.outcome
        finally:
            connections.close_all()

    release = threading.Event()

    def block() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(1768187245, %s)", [held])
                blocking.set()
                release.wait(30)
        finally:
            connections.close_all()

    blocking = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        blocker = pool.submit(block)
        assert blocking.wait(30)
        first = pool.submit(run, *claims[0])
        wait_for_lock_waiters(1)
        second = pool.submit(run, *claims[1])
        wait_for_lock_waiters(2)
        release.set()
        blocker.result(30)
        outcomes = {first.result(30), second.result(30)}
    assert outcomes == {storage.Outcome.WON, storage.Outcome.FOUND}


# No secret ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_database_without_the_secret_refuses_the_request_with_the_fix_in_the_log(
    caplog: pytest.LogCaptureFixture, token_user: TokenUser, secret_unread: None
) -> None:
    with connection.cursor() as cursor:
        # Rolled back with the test's transaction.
        cursor.execute("ALTER TABLE django_idempotency_secret RENAME TO moved_away")
    response = token_user.client().post(
        "/api/charges/",
        {"amount": 2499, "currency": "inr"},
        format="json",
        HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()),
    )
    assert response.status_code == 500
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["type"].endswith(Misconfigured.name)
    assert not Charge.objects.filter(user=token_user.user).exists()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(
        "ChargeCreateView" in m and "manage.py migrate django_idempotency" in m for m in errors
    ), errors


@pytest.mark.django_db
def test_the_secret_is_made_by_the_migration_and_not_seen_by_a_flush() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT id, length(secret) FROM django_idempotency_secret")
        assert cursor.fetchall() == [(1, 64)]
    tables = connection.introspection.django_table_names(only_existing=True)
    assert secret.TABLE not in tables
