"""ASGI: the payments API under uvicorn (2 worker processes), on the test database.

The key end-to-end tests of ``test_e2e_payments`` run here again with uvicorn's URL: sync views
under ASGI (Django runs each in a thread) keep every guarantee. The async view
``/api/charges/async/`` must keep them too, under uvicorn and under gunicorn (WSGI).
"""

from __future__ import annotations

import inspect
import uuid
from collections import Counter
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import requests
from asgiref.sync import iscoroutinefunction

from testproject.payments import views
from testproject.payments.models import Charge
from tests.conftest import TokenUser
from tests.scenarios import test_concurrency as concurrency
from tests.scenarios import test_e2e_payments as e2e
from tests.support.client import honouring_retry_after, replayed
from tests.support.payments import CHARGE, counts, post, records, send_at_once
from tests.support.servers import InProcessServer

ASYNC = "/api/charges/async/"
ADRF = "/api/charges/adrf/"
SERVERS = pytest.mark.parametrize("server", ["live_uvicorn", "live_gunicorn"])
# The async Django view under @idempotent, and the async DRF view (adrf) under the mixin.
ASYNC_VIEWS = pytest.mark.parametrize("path", [ASYNC, ADRF], ids=["decorator", "adrf"])


@pytest.fixture
def alice(live_user: TokenUser) -> TokenUser:
    return live_user


def test_the_api_is_served_by_uvicorn(live_uvicorn: str, alice: Any) -> None:
    answer = post(live_uvicorn, alice, str(uuid.uuid4()), CHARGE)

    assert answer.status_code == 201, answer.text
    assert answer.headers["server"] == "uvicorn"


# Sync views under ASGI: the end-to-end tests, unchanged, against uvicorn.


@pytest.mark.parametrize("delay_ms", [0, 2500], ids=["fast", "slow"])
def test_parallel_identical_requests_execute_once(
    request: pytest.FixtureRequest, alice: Any, delay_ms: int
) -> None:
    e2e.test_parallel_identical_requests_execute_once(
        request, alice, server="live_uvicorn", clients=20, delay_ms=delay_ms
    )


@pytest.mark.parametrize(("fail", "path"), [("after_write", "/api/charges-django/")])
def test_failed_first_attempt_commits_nothing_and_frees_the_key(
    live_uvicorn: str, alice: Any, fail: str, path: str
) -> None:
    e2e.test_failed_first_attempt_commits_nothing_and_frees_the_key(live_uvicorn, alice, fail, path)


@pytest.mark.parametrize("path", ["/api/charges/"])
def test_worker_killed_after_its_write_leaves_nothing_and_the_retry_executes_once(
    live_uvicorn: str, alice: Any, path: str
) -> None:
    e2e.test_worker_killed_after_its_write_leaves_nothing_and_the_retry_executes_once(
        live_uvicorn, alice, path
    )


def test_duplicate_waiting_on_a_first_attempt_that_rolls_back_executes_itself(
    live_uvicorn_waiting: str, alice: Any
) -> None:
    e2e.test_duplicate_waiting_on_a_first_attempt_that_rolls_back_executes_itself(
        live_uvicorn_waiting, alice
    )


# The async view: the same guarantees, under ASGI and under WSGI.


def test_the_async_view_stays_async_under_its_decorators() -> None:
    # Django runs a view on the event loop only if the outermost callable is a coroutine
    # function; otherwise the tests below would exercise a sync view.
    assert iscoroutinefunction(views.charge_async)
    assert iscoroutinefunction(inspect.unwrap(views.charge_async))
    assert iscoroutinefunction(views.AsyncChargeCreateView.as_view())


@ASYNC_VIEWS
def test_async_view_refuses_a_request_without_a_key_or_credentials(
    live_uvicorn: str, alice: Any, path: str
) -> None:
    missing = post(live_uvicorn, alice, None, CHARGE, path)
    anonymous = requests.post(
        live_uvicorn + path, json=CHARGE, headers={"Idempotency-Key": "k"}, timeout=10
    )

    assert missing.status_code == 400
    assert missing.json()["type"].endswith("missing-key")
    assert anonymous.status_code == 401


@ASYNC_VIEWS
@SERVERS
def test_async_view_executes_once_and_replays(
    request: pytest.FixtureRequest, alice: Any, server: str, path: str
) -> None:
    base_url = request.getfixturevalue(server)
    key = str(uuid.uuid4())
    before = counts(base_url)

    first = post(base_url, alice, key, CHARGE, path)
    retries = [post(base_url, alice, key, CHARGE, path) for _ in range(5)]
    other = post(base_url, alice, key, {**CHARGE, "amount": 1}, path)

    assert (first.status_code, replayed(first)) == (201, False), first.text
    assert first.json()["user"] == alice.user.username
    assert [(r.status_code, replayed(r), r.content) for r in retries] == [
        (201, True, first.content)
    ] * 5
    assert other.status_code == 422
    assert counts(base_url) - before == (1, 1)
    assert records(key) == 1


@ASYNC_VIEWS
@pytest.mark.parametrize(
    ("server", "delay_ms"),
    [("live_uvicorn", 0), ("live_uvicorn", 2500)],
    ids=["uvicorn-fast", "uvicorn-slow"],
)
def test_async_view_parallel_identical_requests_execute_once(
    request: pytest.FixtureRequest, alice: Any, server: str, delay_ms: int, path: str
) -> None:
    base_url = request.getfixturevalue(server)
    key = str(uuid.uuid4())
    body = {**CHARGE, "delay_ms": delay_ms}
    before = counts(base_url)

    answers = send_at_once([partial(post, base_url, alice, key, body, path)] * 20)

    statuses = Counter((a.status_code, replayed(a)) for a in answers)
    assert set(statuses) <= {(201, False), (201, True), (409, False)}, statuses
    assert statuses[(201, False)] == 1, statuses
    assert len({a.content for a in answers if a.status_code == 201}) == 1
    assert counts(base_url) - before == (1, 1)
    assert Charge.objects.filter(user=alice.user).count() == 1
    assert records(key) == 1


@ASYNC_VIEWS
@pytest.mark.parametrize(
    ("server", "fault"),
    [("live_uvicorn", "crash_once"), ("live_gunicorn", "fail_once")],
)
def test_async_view_rolls_back_a_failed_attempt_and_the_retry_executes_once(
    request: pytest.FixtureRequest, alice: Any, server: str, fault: str, path: str
) -> None:
    base_url = request.getfixturevalue(server)
    key = str(uuid.uuid4())
    # Both faults strike after the charge is written: only one transaction can undo it.
    body = {**CHARGE, fault: str(uuid.uuid4())}
    before = counts(base_url)

    try:
        failed: int | None = post(base_url, alice, key, body, path).status_code
    except requests.ConnectionError:  # crash_once: the worker died mid-request
        failed = None
    after_failure = counts(base_url)
    records_after_failure = records(key)
    retry = honouring_retry_after(lambda: post(base_url, alice, key, body, path))
    replay = post(base_url, alice, key, body, path)

    assert failed == (500 if fault == "fail_once" else None)
    assert after_failure - before == (1, 0)
    assert records_after_failure == 0
    assert (retry.status_code, replayed(retry)) == (201, False), retry.text
    assert (replay.status_code, replayed(replay), replay.content) == (201, True, retry.content)
    assert counts(base_url) - before == (2, 1)
    assert records(key) == 1


# The concurrency tests, whose gates and call counters live in the test process, against
# Django's ASGI handler served in-process (``asgi_live_server``) instead of ``live_server``.

IN_PROCESS_URLS = pytest.mark.urls("tests.support.urls")


@pytest.fixture
def many_waiters(settings: Any) -> Any:
    """As in ``test_concurrency``: waiting on, and every duplicate of the one process may
    wait."""
    settings.IDEMPOTENCY_WAIT = timedelta(seconds=2)
    settings.IDEMPOTENCY_MAX_WAITERS = 100
    return settings


VIEWS = pytest.mark.parametrize("path", ["/drf/", "/plain/", "/adrf/"])


@IN_PROCESS_URLS
@pytest.mark.django_db(transaction=True)
@VIEWS
def test_parallel_duplicates_that_wait_get_the_replay_of_the_one_execution(
    asgi_live_server: InProcessServer, many_waiters: Any, path: str
) -> None:
    concurrency.test_parallel_duplicates_that_wait_get_the_replay_of_the_one_execution(
        asgi_live_server, many_waiters, path
    )


@IN_PROCESS_URLS
@pytest.mark.django_db(transaction=True)
@VIEWS
def test_waiting_duplicate_executes_when_the_first_rolls_back(
    asgi_live_server: InProcessServer, many_waiters: Any, path: str
) -> None:
    concurrency.test_waiting_duplicate_executes_when_the_first_rolls_back(
        asgi_live_server, many_waiters, path
    )


@IN_PROCESS_URLS
@pytest.mark.django_db(transaction=True)
@VIEWS
@pytest.mark.parametrize("sleep", [0, 0.5], ids=["fast", "slow"])
def test_racing_identical_requests_execute_once_and_never_5xx(
    asgi_live_server: InProcessServer, many_waiters: Any, path: str, sleep: float
) -> None:
    concurrency.test_racing_identical_requests_execute_once_and_never_5xx(
        asgi_live_server, path, 20, sleep
    )
