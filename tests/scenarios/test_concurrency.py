"""Section 6 with real threads over real connections: a live server, or claims on their own
connections. Gates (``tests.support.views.GATES``) and ``pg_locks`` order the requests, so nothing
here depends on how fast the machine is."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import requests
from django.db import connection, connections, transaction

from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions import apply, catalog
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.storage.records import Outcome
from tests.factories import ScriptFactory, TokenFactory, new_key
from tests.reliability.forgery import forge_colliding_key
from tests.support.claims import claim, held_claim, store_first, wait_for_waiting_requests
from tests.support.client import replayed
from tests.support.servers import waiting_env
from tests.support.views import CALLS, GATES, business_rows

pytestmark = [pytest.mark.urls("tests.support.urls"), pytest.mark.django_db(transaction=True)]

ENDPOINTS = pytest.mark.parametrize("path", ["/drf/", "/plain/"])
# Longer than any wait a test allows on purpose: a request that should not wait that long
# fails the test by timing out instead of hanging it.
TIMEOUT = 90


@pytest.fixture(autouse=True)
def many_waiters(settings: Any) -> None:
    """Waiting on, and every duplicate of the live server's one process may wait; the
    default (no waiting) and the cap on waiters have tests of their own (test_waiting)."""
    settings.IDEMPOTENCY_WAIT = timedelta(seconds=2)
    settings.IDEMPOTENCY_MAX_WAITERS = 100


def post(
    url: str, script: dict[str, Any], key: str, timeout: float = TIMEOUT, **headers: str
) -> requests.Response:
    return requests.post(
        url, data=json.dumps(script), timeout=timeout,
        headers={"Content-Type": "application/json", "Idempotency-Key": key, **headers},
    )  # fmt: skip


def post_retrying(url: str, script: dict[str, Any], key: str, **headers: str) -> requests.Response:
    """``post`` as a client with a retry policy does it: the test server's listen backlog
    is 10, so a burst of connections may be reset, and the client retries with the same
    key (which is what the key is for)."""
    for _ in range(5):
        try:
            return post(url, script, key, **headers)
        except requests.ConnectionError:
            continue
    return post(url, script, key, **headers)


def start_gated_first(
    pool: ThreadPoolExecutor, url: str, script: dict[str, Any], key: str
) -> Future[requests.Response]:
    """Send the first request and return once it holds the key inside the handler."""
    first = pool.submit(post, url, script, key)
    assert GATES.wait_entered(script["gate"], 60), "the first request never reached the view"
    return first


@ENDPOINTS
def test_parallel_duplicates_that_wait_get_the_replay_of_the_one_execution(
    live_server, settings, path: str
) -> None:
    settings.IDEMPOTENCY_MAX_WAIT = timedelta(seconds=60)
    duplicates, url, key = 19, live_server.url + path, new_key()
    script = ScriptFactory(gate=new_key())
    with ThreadPoolExecutor(duplicates + 1) as pool:
        first = start_gated_first(pool, url, script, key)
        waiting = [pool.submit(post, url, script, key, Prefer="wait=60") for _ in range(duplicates)]
        wait_for_waiting_requests(duplicates)
        GATES.open(script["gate"])
        first_response = first.result()
        responses = [future.result() for future in waiting]

    assert first_response.status_code == 201
    assert not replayed(first_response)
    for response in responses:
        assert response.status_code == 201
        assert replayed(response)
        assert response.content == first_response.content
        assert response.headers["Preference-Applied"] == "wait=60"
    assert CALLS[script["tag"]] == 1
    assert business_rows(script["tag"]) == 1
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@ENDPOINTS
def test_duplicates_whose_wait_runs_out_get_409_in_progress_with_retry_after(
    live_server, settings, path: str
) -> None:
    settings.IDEMPOTENCY_WAIT = timedelta(seconds=1)
    duplicates, url, key = 8, live_server.url + path, new_key()
    script = ScriptFactory(gate=new_key())
    with ThreadPoolExecutor(duplicates + 1) as pool:
        first = start_gated_first(pool, url, script, key)
        conflicts = list(pool.map(lambda _: post(url, script, key), range(duplicates)))
        GATES.open(script["gate"])
        first_response = first.result()

    for response in conflicts:
        assert response.status_code == 409
        assert response.headers["Content-Type"] == "application/problem+json"
        assert response.json()["type"].endswith("in-progress")
        assert int(response.headers["Retry-After"]) >= 1
    assert first_response.status_code == 201
    retry = post(url, script, key)
    assert replayed(retry)
    assert retry.content == first_response.content
    assert CALLS[script["tag"]] == 1


@ENDPOINTS
def test_prefer_wait_0_gets_409_at_once_with_preference_applied(
    live_server, settings, path: str
) -> None:
    # Were the preference ignored, the duplicate would wait 60 s and time out below.
    settings.IDEMPOTENCY_WAIT = settings.IDEMPOTENCY_MAX_WAIT = timedelta(seconds=60)
    url, key, script = live_server.url + path, new_key(), ScriptFactory(gate=new_key())
    with ThreadPoolExecutor(1) as pool:
        first = start_gated_first(pool, url, script, key)
        try:
            response = post(url, script, key, timeout=20, Prefer="wait=0")
        finally:
            GATES.open(script["gate"])
        assert first.result().status_code == 201
    assert response.status_code == 409
    assert response.json()["type"].endswith("in-progress")
    assert response.headers["Preference-Applied"] == "wait=0"
    assert int(response.headers["Retry-After"]) >= 1


@ENDPOINTS
def test_prefer_wait_is_capped_by_max_wait(live_server, settings, path: str) -> None:
    settings.IDEMPOTENCY_MAX_WAIT = timedelta(seconds=1)
    url, key, script = live_server.url + path, new_key(), ScriptFactory(gate=new_key())
    with ThreadPoolExecutor(1) as pool:
        first = start_gated_first(pool, url, script, key)
        try:
            response = post(url, script, key, timeout=30, Prefer="wait=120")
        finally:
            GATES.open(script["gate"])
        first.result()
    assert response.status_code == 409
    assert response.headers["Preference-Applied"] == "wait=1"


def test_per_view_wait_applies_without_a_preference(live_server, settings) -> None:
    settings.IDEMPOTENCY_WAIT = settings.IDEMPOTENCY_MAX_WAIT = timedelta(seconds=60)
    url, key, script = live_server.url + "/drf/no-wait/", new_key(), ScriptFactory(gate=new_key())
    with ThreadPoolExecutor(1) as pool:
        first = start_gated_first(pool, url, script, key)
        try:
            response = post(url, script, key, timeout=20)
        finally:
            GATES.open(script["gate"])
        first.result()
    assert response.status_code == 409
    assert "Preference-Applied" not in response.headers


SLOW_PRINCIPAL_SECONDS = 4


def slow_tenant(request: Any) -> str:
    """A principal callable that takes its time (a tenant looked up on a slow service)."""
    time.sleep(SLOW_PRINCIPAL_SECONDS)
    return "tenant:slow"


@ENDPOINTS
def test_a_duplicates_wait_counts_from_its_arrival_not_from_the_claim(
    live_server, settings, path: str
) -> None:
    # Contract 6: what a request spent before its claim (authentication, the principal
    # callable) comes out of its wait. Here all of it: it is told 409 once its own 4 s are up,
    # not after 4 more s of waiting at the claim.
    settings.IDEMPOTENCY_MAX_WAIT = timedelta(seconds=60)
    settings.IDEMPOTENCY_PRINCIPAL = slow_tenant
    url, key, script = live_server.url + path, new_key(), ScriptFactory()
    with held_claim("tenant:slow", key):
        started = time.monotonic()
        response = post(url, script, key, Prefer=f"wait={SLOW_PRINCIPAL_SECONDS}")
        answered_in = time.monotonic() - started
    print(f"answered in {answered_in:.2f}s")
    assert response.status_code == 409
    assert response.headers["Preference-Applied"] == f"wait={SLOW_PRINCIPAL_SECONDS}"
    # Waiting from the claim would take twice the wait: 8 s or more.
    assert answered_in < SLOW_PRINCIPAL_SECONDS * 1.75
    assert CALLS[script["tag"]] == 0


@ENDPOINTS
def test_waiting_duplicate_executes_when_the_first_rolls_back(
    live_server, settings, path: str
) -> None:
    settings.IDEMPOTENCY_MAX_WAIT = timedelta(seconds=60)
    url, key = live_server.url + path, new_key()
    script = ScriptFactory(gate=new_key(), fail="raise", once=True)
    with ThreadPoolExecutor(2) as pool:
        first = start_gated_first(pool, url, script, key)
        duplicate = pool.submit(post, url, script, key, Prefer="wait=60")
        wait_for_waiting_requests(1)
        GATES.open(script["gate"])
        first_response, duplicate_response = first.result(), duplicate.result()

    assert first_response.status_code == 500
    assert duplicate_response.status_code == 201
    assert not replayed(duplicate_response)
    assert duplicate_response.json()["execution"] == 2
    assert business_rows(script["tag"]) == 1
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


def race(count: int, send: Callable[[], requests.Response]) -> list[requests.Response]:
    """``count`` requests released at the same moment, each on its own thread."""
    barrier = threading.Barrier(count)

    def go(_: int) -> requests.Response:
        barrier.wait(60)
        return send()

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(go, range(count)))


@ENDPOINTS
@pytest.mark.parametrize(
    ("count", "sleep"), [(20, 0), (50, 0), (20, 0.5)], ids=["20-fast", "50-fast", "20-slow"]
)
def test_racing_identical_requests_execute_once_and_never_5xx(
    live_server, path: str, count: int, sleep: float
) -> None:
    url, key, script = live_server.url + path, new_key(), ScriptFactory(sleep=sleep)
    responses = race(count, lambda: post_retrying(url, script, key))
    statuses = Counter(response.status_code for response in responses)
    assert set(statuses) <= {201, 409}, statuses
    executed = [r for r in responses if r.status_code == 201 and not replayed(r)]
    assert len(executed) <= 1
    successes = {r.content for r in responses if r.status_code == 201}
    assert len(successes) == 1
    for response in responses:
        if response.status_code == 409:
            assert int(response.headers["Retry-After"]) >= 1
    assert CALLS[script["tag"]] == 1
    assert business_rows(script["tag"]) == 1


def test_racing_requests_of_two_principals_with_one_key_execute_once_each(live_server) -> None:
    alice, bob = TokenFactory(), TokenFactory()
    url, key, script = live_server.url + "/drf/guarded/", new_key(), ScriptFactory(sleep=0.2)
    tokens = [alice, bob] * 10
    turn = iter(range(len(tokens)))
    lock = threading.Lock()

    def send() -> requests.Response:
        with lock:
            token = tokens[next(turn)]
        response = post_retrying(url, script, key, Authorization=f"Token {token.key}")
        response.principal = token.user.pk  # type: ignore[attr-defined]
        return response

    responses = race(len(tokens), send)
    by_principal: dict[int, set[bytes]] = defaultdict(set)
    for response in responses:
        assert response.status_code in (201, 409)
        if response.status_code == 201:
            by_principal[response.principal].add(response.content)  # type: ignore[attr-defined]
    # Each principal saw one response of its own, never the other's.
    assert all(len(contents) == 1 for contents in by_principal.values())
    assert by_principal[alice.user.pk].isdisjoint(by_principal[bob.user.pk])
    assert CALLS[script["tag"]] == 2
    assert IdempotencyRecord.objects.filter(key=key).count() == 2


# Claims straddling midnight UTC: one key, two daily partitions, one winner.

# Microseconds around the boundary: the claims of one key land on both sides of it.
OFFSETS = [-3000, -2000, -1000, -1, 0, 1, 1000, 3000]
ROUNDS = 40


def test_claims_straddling_midnight_utc_never_produce_two_winners() -> None:
    day = catalog.utc_today() + timedelta(days=2)
    midnight = datetime(day.year, day.month, day.day, tzinfo=UTC)
    for made in (day - timedelta(days=1), day):
        apply.create_partition(connection, RECORDS, made, retry_for=timedelta(seconds=5))
    keys = [new_key() for _ in range(ROUNDS)]
    outcomes: dict[str, list[str]] = defaultdict(list)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(OFFSETS))

    def worker(index: int) -> None:
        try:
            for round_, key in enumerate(keys):
                # Rotate the offsets so that early and late claims come from every thread.
                now = midnight + timedelta(microseconds=OFFSETS[(index + round_) % len(OFFSETS)])
                barrier.wait(60)
                with transaction.atomic():
                    claimed = claim("anonymous", key, now=now, wait=timedelta(seconds=30))
                    if claimed.outcome is Outcome.WON:
                        store_first("anonymous", key, claimed, ttl=timedelta(hours=24))
                outcomes[key].append(claimed.outcome)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(OFFSETS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors

    for key in keys:
        assert Counter(outcomes[key]) == {
            Outcome.WON: 1,
            Outcome.FOUND: len(OFFSETS) - 1,
        }
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tableoid::regclass::text, count(*), count(DISTINCT key) "
            "FROM django_idempotency_record WHERE key = ANY(%s) GROUP BY 1",
            [keys],
        )
        rows = cursor.fetchall()
    assert sum(count for _, count, _ in rows) == ROUNDS
    assert sum(distinct for _, _, distinct in rows) == ROUNDS
    # The winners landed on both sides of midnight: the test did straddle it.
    assert {table for table, _, _ in rows} == {
        RECORDS.partition_name(day - timedelta(days=1)),
        RECORDS.partition_name(day),
    }


# Holes found under attack (issue 9).


@pytest.mark.django_db(transaction=True)
def test_a_key_forged_to_collide_under_the_old_unkeyed_lock_no_longer_blocks_its_victim() -> None:
    victim_key = new_key()
    forged = forge_colliding_key("user:1", victim_key, "user:2", random.Random(7))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT hashtextextended(%s, 0) = hashtextextended(%s, 0)",
            ["user:1\x01" + victim_key, "user:2\x01" + forged],
        )
        assert cursor.fetchone() == (True,)  # a true collision for the old scheme
    with held_claim("user:1", victim_key), transaction.atomic():
        started = time.monotonic()
        claimed = claim("user:2", forged, wait=timedelta(seconds=2))
        assert claimed.outcome is Outcome.WON
        assert time.monotonic() - started < 1
        with connection.cursor() as cursor:
            # Our locks live in a lock space of the app's own: the two-integer form
            # (objsubid 2) under our class id, never the bigint space others use.
            cursor.execute(
                "SELECT classid, objsubid FROM pg_locks WHERE locktype = 'advisory' "
                "AND pid = pg_backend_pid()"
            )
            assert cursor.fetchall() == [(1768187245, 2)]


@pytest.mark.django_db(transaction=True)
def test_waiting_duplicates_are_capped_per_process_and_others_are_still_served(
    gunicorn_server: Any, make_token_user: Any
) -> None:
    alice = make_token_user("waiter-alice")
    key, body = new_key(), {"amount": 100, "currency": "inr", "delay_ms": 3000}
    headers = {**alice.headers, "Idempotency-Key": key, "Prefer": "wait=10"}
    # Waiting on as the docs show it, with a cap of 4 on a process of 12 threads.
    env = waiting_env(max_waiters=4, threads=12)
    with gunicorn_server(workers=1, threads=12, env=env) as server, ThreadPoolExecutor(16) as pool:
        url = server.url + "/api/charges/"
        holder = {**alice.headers, "Idempotency-Key": key}
        first = pool.submit(requests.post, url, json=body, headers=holder, timeout=30)
        time.sleep(0.5)
        duplicates = [
            pool.submit(requests.post, url, json=body, headers=headers, timeout=30)
            for _ in range(10)
        ]
        time.sleep(0.5)
        started = time.monotonic()
        other = requests.get(server.url + "/api/charges/count/", timeout=30)
        served_in = time.monotonic() - started
        answers = [d.result() for d in duplicates]
        assert first.result().status_code == 201
    assert other.status_code == 200
    assert served_in < 1.0
    statuses = Counter(a.status_code for a in answers)
    # The cap: 4 wait for the first and get its replay, the rest are told at once.
    assert statuses == {201: 4, 409: 6}, statuses
    assert all(a.headers["Preference-Applied"] == "wait=10" for a in answers)
