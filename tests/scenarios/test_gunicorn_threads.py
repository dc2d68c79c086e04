"""gunicorn given its threads on its command line only (no IDEMPOTENCY_SERVER_THREADS, no
GUNICORN_CMD_ARGS), with IDEMPOTENCY_MAX_WAITERS = 4 on 4 threads: bystanders used to wait
3.5-3.9 s behind waiting duplicates with no warning. ``manage.py check`` cannot see that
command line; the worker can, and says W008 in its log at the first wait."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.factories import new_key
from tests.support.servers import waiting_env

pytestmark = pytest.mark.django_db(transaction=True)

WARNING = (
    "IDEMPOTENCY_MAX_WAITERS is 4, but a server process has 4 request thread(s) "
    "(gunicorn's command line)"
)


def test_a_cap_as_high_as_the_command_lines_threads_is_w008_in_the_workers_log(
    gunicorn_server: Any, make_token_user: Any
) -> None:
    alice = make_token_user("threads-alice")
    key, body = new_key(), {"amount": 100, "currency": "inr", "delay_ms": 2000}
    env = waiting_env(max_waiters=4)  # threads=None: only gunicorn's --threads says 4
    with gunicorn_server(workers=1, threads=4, env=env) as server, ThreadPoolExecutor(2) as pool:
        url = server.url + "/api/charges/"
        headers = {**alice.headers, "Idempotency-Key": key}
        first = pool.submit(requests.post, url, json=body, headers=headers, timeout=30)
        time.sleep(0.5)
        duplicate = requests.post(url, json=body, headers=headers, timeout=30)
        assert first.result().status_code == 201
        log = server.log_text()
    # The duplicate waited (a waiter slot, capped at 3 of 4 threads) and got the replay.
    assert duplicate.status_code == 201 and duplicate.headers["Idempotent-Replayed"] == "true"
    assert log.count(WARNING) == 1, log[-3000:]
    assert "Set IDEMPOTENCY_MAX_WAITERS to 3 or fewer" in log
