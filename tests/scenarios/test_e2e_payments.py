"""End to end: real HTTP against the payments API under gunicorn with several worker
processes, on the test database. Exactly-once is judged by the handler's own execution
counter (a sequence, so it survives rollbacks and dead workers) and by the committed rows.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
import requests

from testproject.payments.models import Charge, Payment, Refund
from tests.support.client import honouring_retry_after, replayed
from tests.support.payments import CHARGE, counts, post, records, send_at_once, start_first

pytestmark = pytest.mark.django_db(transaction=True)

# endpoint -> (the model it writes, the endpoint counting it)
ENDPOINTS: dict[str, tuple[type[Payment], str]] = {
    "/api/charges/": (Charge, "/api/charges/count/"),
    "/api/refunds/": (Refund, "/api/refunds/count/"),
    "/api/charges-django/": (Charge, "/api/charges/count/"),
}


@pytest.fixture
def alice(make_token_user: Any) -> Any:
    return make_token_user("alice")


@pytest.fixture
def bob(make_token_user: Any) -> Any:
    return make_token_user("bob")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_hundred_sequential_retries_execute_once_and_replay_identical_bytes(
    live_gunicorn: str, alice: Any, path: str
) -> None:
    model, count_path = ENDPOINTS[path]
    key = str(uuid.uuid4())
    before = counts(live_gunicorn, count_path)

    first = post(live_gunicorn, alice, key, CHARGE, path)
    retries = [post(live_gunicorn, alice, key, CHARGE, path) for _ in range(99)]

    assert first.status_code == 201, first.text
    assert not replayed(first)
    assert first.json()["amount"] == CHARGE["amount"]
    assert [(r.status_code, replayed(r)) for r in retries] == [(201, True)] * 99
    assert {r.content for r in retries} == {first.content}
    assert {r.headers["Content-Type"] for r in retries} == {first.headers["Content-Type"]}
    assert counts(live_gunicorn, count_path) - before == (1, 1)
    assert model._default_manager.filter(user=alice.user).count() == 1
    assert records(key) == 1


def test_plain_baseline_executes_every_request(live_gunicorn: str, alice: Any) -> None:
    key = str(uuid.uuid4())
    before = counts(live_gunicorn)

    answers = [post(live_gunicorn, alice, key, CHARGE, "/api/charges-plain/") for _ in range(3)]

    assert [(a.status_code, replayed(a)) for a in answers] == [(201, False)] * 3
    assert len({a.json()["id"] for a in answers}) == 3
    assert counts(live_gunicorn) - before == (3, 3)
    assert records(key) == 0


# 2500 ms outlasts the default 2 s wait of a duplicate, so the slow case also gets 409s.
@pytest.mark.parametrize("delay_ms", [0, 2500], ids=["fast", "slow"])
@pytest.mark.parametrize("clients", [20, 50])
@pytest.mark.parametrize("server", ["live_gunicorn", "live_gunicorn_threads"])
def test_parallel_identical_requests_execute_once(
    request: pytest.FixtureRequest, alice: Any, server: str, clients: int, delay_ms: int
) -> None:
    base_url = request.getfixturevalue(server)
    key = str(uuid.uuid4())
    body = {**CHARGE, "delay_ms": delay_ms}
    before = counts(base_url)

    answers = send_at_once([partial(post, base_url, alice, key, body)] * clients)

    statuses = Counter((a.status_code, replayed(a)) for a in answers)
    assert set(statuses) <= {(201, False), (201, True), (409, False)}, statuses
    assert statuses[(201, False)] == 1, statuses
    created = [a for a in answers if a.status_code == 201]
    assert len({a.content for a in created}) == 1
    for conflict in (a for a in answers if a.status_code == 409):
        assert conflict.headers["Content-Type"] == "application/problem+json"
        assert conflict.json()["type"].endswith("in-progress")
        assert int(conflict.headers["Retry-After"]) >= 1
    assert counts(base_url) - before == (1, 1)
    assert Charge.objects.filter(user=alice.user).count() == 1
    assert records(key) == 1
    retry = post(base_url, alice, key, body)
    assert (retry.status_code, replayed(retry), retry.content) == (201, True, created[0].content)


def test_with_claim_first_racing_duplicates_execute_once_and_retries_are_replayed_over_http(
    gunicorn_server: Callable[..., Any], alice: Any
) -> None:
    """The claim without the lookup before it (IDEMPOTENCY_LOOKUP_FIRST = False), as a client
    sees it: the same answers as the default's."""
    env = {"DJANGO_SETTINGS_MODULE": "tests.support.claim_first_settings"}
    with gunicorn_server(workers=2, threads=4, env=env) as server:
        base_url, key = server.url, str(uuid.uuid4())
        before = counts(base_url)
        answers = send_at_once([partial(post, base_url, alice, key, CHARGE)] * 20)
        statuses = Counter((a.status_code, replayed(a)) for a in answers)
        assert set(statuses) <= {(201, False), (201, True), (409, False)}, statuses
        assert statuses[(201, False)] == 1, statuses
        first = next(a for a in answers if (a.status_code, replayed(a)) == (201, False))
        retry = post(base_url, alice, key, CHARGE)
        reused = post(base_url, alice, key, {**CHARGE, "amount": 999})
        assert (retry.status_code, replayed(retry), retry.content) == (201, True, first.content)
        assert reused.status_code == 422 and reused.json()["type"].endswith("key-reused")
        assert counts(base_url) - before == (1, 1)
    assert records(key) == 1


def test_same_key_from_two_principals_executes_once_each_and_never_crosses(
    live_gunicorn: str, alice: Any, bob: Any
) -> None:
    key = str(uuid.uuid4())
    before = counts(live_gunicorn)

    first = {user.user.username: post(live_gunicorn, user, key, CHARGE) for user in (alice, bob)}
    users = [alice, bob] * 10
    parallel = send_at_once([partial(post, live_gunicorn, user, key, CHARGE) for user in users])

    assert [(a.status_code, replayed(a)) for a in first.values()] == [(201, False)] * 2
    assert first["alice"].json()["user"] == "alice"
    assert first["bob"].json()["user"] == "bob"
    assert first["alice"].json()["id"] != first["bob"].json()["id"]
    for user, answer in zip(users, parallel, strict=True):
        assert (answer.status_code, replayed(answer)) == (201, True)
        assert answer.content == first[user.user.username].content
    assert counts(live_gunicorn) - before == (2, 2)
    assert Charge.objects.filter(user=alice.user).count() == 1
    assert Charge.objects.filter(user=bob.user).count() == 1
    assert records(key) == 2


def test_two_principals_racing_on_one_key_each_execute_once(
    live_gunicorn_threads: str, alice: Any, bob: Any
) -> None:
    key = str(uuid.uuid4())
    before = counts(live_gunicorn_threads)

    users = [alice, bob] * 10
    answers = send_at_once(
        [partial(post, live_gunicorn_threads, user, key, CHARGE) for user in users]
    )

    for racer in (alice, bob):
        own = [a for user, a in zip(users, answers, strict=True) if user is racer]
        statuses = Counter((a.status_code, replayed(a)) for a in own)
        assert set(statuses) <= {(201, False), (201, True), (409, False)}, statuses
        assert statuses[(201, False)] == 1, statuses
        created = [a for a in own if a.status_code == 201]
        assert len({a.content for a in created}) == 1
        assert created[0].json()["user"] == racer.user.username
    assert counts(live_gunicorn_threads) - before == (2, 2)


def test_key_reused_for_a_different_request_is_422_and_runs_nothing(
    live_gunicorn: str, alice: Any
) -> None:
    key = str(uuid.uuid4())
    first = post(live_gunicorn, alice, key, CHARGE)
    before = counts(live_gunicorn)

    other_body = post(live_gunicorn, alice, key, {**CHARGE, "amount": 999})
    other_path = post(live_gunicorn, alice, key, CHARGE, "/api/refunds/")
    retry = post(live_gunicorn, alice, key, CHARGE)

    assert first.status_code == 201
    for answer, differing in [(other_body, ["body"]), (other_path, ["path"])]:
        assert answer.status_code == 422, answer.text
        assert answer.headers["Content-Type"] == "application/problem+json"
        problem = answer.json()
        assert problem["type"].endswith("key-reused")
        assert problem["differing"] == differing
        assert "999" not in answer.text
    assert (retry.status_code, replayed(retry), retry.content) == (201, True, first.content)
    assert counts(live_gunicorn) - before == (0, 0)
    assert Refund.objects.count() == 0
    assert records(key) == 1


def test_key_order_in_the_body_does_not_matter(live_gunicorn: str, alice: Any) -> None:
    key = str(uuid.uuid4())
    first = post(live_gunicorn, alice, key, {"amount": 2499, "currency": "inr"})
    reordered = post(live_gunicorn, alice, key, {"currency": "inr", "amount": 2499})

    assert (reordered.status_code, replayed(reordered)) == (201, True)
    assert reordered.content == first.content


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("fail", ["500", "500r", "after_write"])
def test_failed_first_attempt_commits_nothing_and_frees_the_key(
    live_gunicorn: str, alice: Any, fail: str, path: str
) -> None:
    model, count_path = ENDPOINTS[path]
    key = str(uuid.uuid4())
    failing = {**CHARGE, "fail": fail}
    before = counts(live_gunicorn, count_path)

    failed = [post(live_gunicorn, alice, key, failing, path) for _ in range(2)]
    after_failures = counts(live_gunicorn, count_path)
    records_after_failures = records(key)
    retry = post(live_gunicorn, alice, key, CHARGE, path)
    replay = post(live_gunicorn, alice, key, CHARGE, path)

    # A 5xx is never stored: the same failing request runs (and fails) again.
    assert [(a.status_code, replayed(a)) for a in failed] == [(500, False)] * 2
    assert after_failures - before == (2, 0)
    assert records_after_failures == 0
    assert (retry.status_code, replayed(retry)) == (201, False)
    assert (replay.status_code, replayed(replay), replay.content) == (201, True, retry.content)
    assert counts(live_gunicorn, count_path) - before == (3, 1)
    assert model._default_manager.filter(user=alice.user).count() == 1
    assert records(key) == 1


@pytest.mark.parametrize("path", ENDPOINTS)
def test_transient_failure_then_identical_retry_executes_once(
    live_gunicorn: str, alice: Any, path: str
) -> None:
    model, count_path = ENDPOINTS[path]
    key = str(uuid.uuid4())
    body = {**CHARGE, "fail_once": str(uuid.uuid4())}
    before = counts(live_gunicorn, count_path)

    failed = post(live_gunicorn, alice, key, body, path)
    rows_after_failure = model._default_manager.count()
    retry = post(live_gunicorn, alice, key, body, path)
    replay = post(live_gunicorn, alice, key, body, path)

    assert failed.status_code == 500
    assert rows_after_failure == 0
    assert (retry.status_code, replayed(retry)) == (201, False)
    assert (replay.status_code, replayed(replay), replay.content) == (201, True, retry.content)
    assert counts(live_gunicorn, count_path) - before == (2, 1)
    assert records(key) == 1


@pytest.mark.parametrize("path", ENDPOINTS)
def test_worker_killed_after_its_write_leaves_nothing_and_the_retry_executes_once(
    live_gunicorn: str, alice: Any, path: str
) -> None:
    model, count_path = ENDPOINTS[path]
    key = str(uuid.uuid4())
    body = {**CHARGE, "crash_once": str(uuid.uuid4())}
    before = counts(live_gunicorn, count_path)

    with pytest.raises(requests.ConnectionError):
        post(live_gunicorn, alice, key, body, path)
    after_crash = counts(live_gunicorn, count_path)
    records_after_crash = records(key)
    retry = honouring_retry_after(lambda: post(live_gunicorn, alice, key, body, path))
    replay = post(live_gunicorn, alice, key, body, path)

    assert after_crash - before == (1, 0)
    assert records_after_crash == 0
    assert (retry.status_code, replayed(retry)) == (201, False), retry.text
    assert (replay.status_code, replayed(replay), replay.content) == (201, True, retry.content)
    assert counts(live_gunicorn, count_path) - before == (2, 1)
    assert model._default_manager.filter(user=alice.user).count() == 1
    assert records(key) == 1


def test_plain_django_view_requires_a_key_and_replays(live_gunicorn: str, alice: Any) -> None:
    key = str(uuid.uuid4())
    before = counts(live_gunicorn)

    missing = post(live_gunicorn, alice, None, CHARGE, "/api/charges-django/")
    anonymous = requests.post(
        live_gunicorn + "/api/charges-django/",
        json=CHARGE,
        headers={"Idempotency-Key": key},
        timeout=10,
    )
    invalid = post(
        live_gunicorn, alice, key, {"amount": 0, "currency": "inr"}, "/api/charges-django/"
    )

    assert missing.status_code == 400
    assert missing.json()["type"].endswith("missing-key")
    assert anonymous.status_code == 401
    # The view's own 4xx is stored like any other answer, so it replays too.
    assert invalid.status_code == 400
    assert "amount" in invalid.json()
    again = post(
        live_gunicorn, alice, key, {"amount": 0, "currency": "inr"}, "/api/charges-django/"
    )
    assert (again.status_code, replayed(again), again.content) == (400, True, invalid.content)
    assert counts(live_gunicorn) - before == (1, 0)


def test_duplicate_waiting_on_a_first_attempt_that_rolls_back_executes_itself(
    live_gunicorn_waiting: str, alice: Any
) -> None:
    # Waiting is opt-in: on a server that waits as the docs show it.
    key = str(uuid.uuid4())
    # The first attempt writes, then fails after a second; its duplicate arrives meanwhile.
    body = {**CHARGE, "fail_once": str(uuid.uuid4()), "delay_ms": 1000}
    before = counts(live_gunicorn_waiting)

    with ThreadPoolExecutor(1) as pool:
        first = start_first(pool, live_gunicorn_waiting, alice, key, body, before)
        duplicate = post(live_gunicorn_waiting, alice, key, body)
        failed = first.result()

    assert failed.status_code == 500
    assert (duplicate.status_code, replayed(duplicate)) == (201, False), duplicate.text
    assert counts(live_gunicorn_waiting) - before == (2, 1)
    assert records(key) == 1


def test_duplicate_that_will_not_wait_gets_409_at_once(
    live_gunicorn_waiting: str, alice: Any
) -> None:
    key = str(uuid.uuid4())
    body = {**CHARGE, "delay_ms": 1500}

    with ThreadPoolExecutor(1) as pool:
        first = start_first(
            pool, live_gunicorn_waiting, alice, key, body, counts(live_gunicorn_waiting)
        )
        impatient = post(live_gunicorn_waiting, alice, key, body, Prefer="wait=0")
        # "At once": answered while the first still runs, not after it (an order of events,
        # which a busy machine cannot upset as it could a number of seconds).
        first_still_running = not first.done()
        patient = post(live_gunicorn_waiting, alice, key, body, Prefer="wait=5")
        created = first.result()

    assert impatient.status_code == 409
    assert impatient.json()["type"].endswith("in-progress")
    assert int(impatient.headers["Retry-After"]) >= 1
    assert first_still_running
    assert (created.status_code, replayed(created)) == (201, False)
    assert (patient.status_code, replayed(patient)) == (201, True)
    assert patient.content == created.content
    assert patient.headers["Preference-Applied"] == "wait=5"


@pytest.mark.parametrize("path", ["/api/charges/", "/api/charges-django/"])
def test_rollback_only_first_attempt_is_500_commits_nothing_and_frees_the_key(
    live_gunicorn: str, alice: Any, path: str
) -> None:
    model, count_path = ENDPOINTS[path]
    key = str(uuid.uuid4())
    before = counts(live_gunicorn, count_path)

    rolled_back = post(live_gunicorn, alice, key, {**CHARGE, "fail": "rollback_only"}, path)
    records_after = records(key)
    retry = post(live_gunicorn, alice, key, CHARGE, path)

    assert rolled_back.status_code == 500, rolled_back.text
    assert rolled_back.headers["Content-Type"] == "application/problem+json"
    assert records_after == 0
    assert (retry.status_code, replayed(retry)) == (201, False)
    assert counts(live_gunicorn, count_path) - before == (2, 1)
    assert model._default_manager.filter(user=alice.user).count() == 1


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_replay_never_carries_the_first_answers_cookie(
    live_gunicorn: str, alice: Any, path: str
) -> None:
    key = str(uuid.uuid4())
    body = {**CHARGE, "set_cookie": "first-answer-only"}

    first = post(live_gunicorn, alice, key, body, path)
    replay = post(live_gunicorn, alice, key, body, path)

    assert (first.status_code, replayed(first)) == (201, False)
    assert first.cookies.get("payments_fault") == "first-answer-only"
    assert (replay.status_code, replayed(replay)) == (201, True)
    assert "Set-Cookie" not in replay.headers
    assert replay.content == first.content


def test_a_patch_replay_checks_ownership_again_over_http(
    live_gunicorn: str, alice: Any, bob: Any
) -> None:
    created = post(live_gunicorn, alice, uuid.uuid4().hex, CHARGE)
    assert created.status_code == 201
    url = f"{live_gunicorn}/api/charges/{created.json()['id']}/"
    key, change = uuid.uuid4().hex, {"description": "team lunch"}
    headers = {**alice.headers, "Idempotency-Key": key}
    first = requests.patch(url, json=change, headers=headers, timeout=10)
    assert first.status_code == 200
    assert first.json()["description"] == "team lunch"
    assert replayed(requests.patch(url, json=change, headers=headers, timeout=10))
    Charge.objects.filter(pk=created.json()["id"]).update(user=bob.user)
    fresh = requests.patch(
        url, json=change, headers={**headers, "Idempotency-Key": uuid.uuid4().hex}, timeout=10
    )
    assert fresh.status_code == 403
    old_key = requests.patch(url, json=change, headers=headers, timeout=10)
    assert old_key.status_code == 403
    assert not replayed(old_key)
