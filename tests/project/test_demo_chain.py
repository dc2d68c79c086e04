"""The demo's chain under its supervisor, with real processes (a private redis-server, the
card processor, a prefork Celery worker and the relay): a relay killed with SIGKILL is
started again, the console says so with its exit code, and ``/api/charges/chain/`` sees the
new relay beat; the worker gets the fault switches."""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("celery")

from testproject.payments import demo_chain
from tests.support.chain_processes import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


@pytest.fixture
def said() -> list[str]:
    return []


@pytest.fixture
def chain(subprocess_env: dict[str, str], said: list[str]) -> Iterator[demo_chain.Chain]:
    # No broker URL: the demo starts a private redis-server of its own.
    env = {**subprocess_env, "CELERY_BROKER_URL": ""}
    env.pop("PAYMENTS_FAULTS_ENABLED", None)
    running = demo_chain.start(quiet=True, say=said.append, env=env)
    yield running
    running.stop()


def counts(client: Any) -> dict[str, Any]:
    response = client.get("/api/charges/chain/")
    assert response.status_code == 200
    answer: dict[str, Any] = response.json()
    return answer


def test_a_killed_relay_is_started_again_said_so_and_seen_beating_by_the_chain_endpoint(
    chain: demo_chain.Chain, said: list[str], client: Any
) -> None:
    first = wait_for(lambda: (c := counts(client))["relay_owner"] and c, timeout=90, every=0.2)
    assert first["relay_heartbeat_age"] < 30 and first["dead_letters"] == 0
    relay = chain.find(demo_chain.RELAY)
    killed = relay.process.pid
    os.kill(killed, signal.SIGKILL)
    # The killed relay's row stops beating and ages, until the new relay beats.
    oldest = 0.0
    while (now := counts(client))["relay_owner"] == first["relay_owner"]:
        oldest = max(oldest, now["relay_heartbeat_age"])
        assert relay.restarts <= 1 and now["relay_heartbeat_age"] < 90, now
    assert now["relay_heartbeat_age"] < oldest, (now, oldest)
    assert relay.restarts == 1 and relay.process.pid != killed
    assert relay.process.poll() is None
    assert (
        f"The demo's relay (manage.py idempotency_relay) (pid {killed}) exited with code -9 "
        "(killed by SIGKILL)"
    ) in "\n".join(said)
    assert f"is running again (pid {relay.process.pid})" in "\n".join(said)
    # The others were left alone.
    assert all(one.restarts == 0 for one in chain.supervised if one is not relay)


def test_the_worker_gets_the_fault_switches_and_a_process_that_keeps_dying_waits_longer(
    chain: demo_chain.Chain, said: list[str]
) -> None:
    worker = chain.find(demo_chain.WORKER)
    environ = Path(f"/proc/{worker.process.pid}/environ").read_bytes().split(b"\0")
    assert b"PAYMENTS_FAULTS_ENABLED=1" in environ
    processor = chain.find(demo_chain.PROCESSOR)
    processor.process.kill()
    wait_for(lambda: processor.restarts == 1 and processor.process.poll() is None, timeout=30)
    # Dead again at once after its start: started again after a pause, not at once.
    again = processor.process.pid
    processor.process.kill()
    wait_for(lambda: processor.restarts == 2, timeout=30)
    (line,) = [line for line in said if f"(pid {again}) exited" in line]
    assert re.search(
        r"code -9 \(killed by SIGKILL\) after [\d.]+ s; starting it again in [12] s\.$", line
    )
