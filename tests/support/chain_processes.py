"""The side-effect chain's processes, shared by ``tests/messaging/test_relay.py``,
``tests/scenarios/test_chain.py`` and the reliability suite's chain profile: a private
``redis-server``, the fake card processor (``testproject/processor.py``) and a prefork Celery
worker.

Everything binds 127.0.0.1 on a free port: never the machine's Redis on 6379.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import requests

from tests.conftest import ROOT, die_with_parent, unmeasured
from tests.support.servers import free_port

# Celery's default queue, and kombu's keys for messages delivered but not yet acknowledged.
QUEUE = "celery"
UNACKED = "unacked"
# The chain's processes run these settings: Redis redelivers a task still running after 2 s.
CHAIN_SETTINGS = "tests.support.chain_settings"


def wait_for(condition: Callable[[], Any], timeout: float = 30, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {condition}")
        time.sleep(every)


@dataclass
class RedisServer:
    """A redis-server of our own on a free port, with an append-only file so that what it
    accepted survives its restart."""

    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    # More redis-server options.
    options: tuple[str, ...] = ()

    @classmethod
    def on_free_port(cls, directory: Path, options: tuple[str, ...] = ()) -> RedisServer:
        return cls(free_port(), directory, options=options)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "always",
             "--save", "", "--logfile", str(self.directory / "redis.log"), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
            start_new_session=True,
        )  # fmt: skip
        wait_for(self.answers, timeout=10)

    def answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        """``kill -9``: what it acknowledged is in its append-only file already."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def queued(self, queue: str = QUEUE) -> list[dict[str, Any]]:
        """The task messages waiting in a queue, oldest first (kombu LPUSHes, BRPOPs)."""
        raw = self.client().lrange(queue, 0, -1)
        return [json.loads(m)["headers"] for m in reversed(raw)]

    def in_flight(self, queue: str = QUEUE) -> tuple[int, int]:
        """(messages waiting in ``queue``, messages delivered and not yet acknowledged)."""
        client = self.client()
        return int(client.llen(queue)), int(client.hlen(UNACKED))


@contextlib.contextmanager
def run_processor() -> Iterator[str]:
    """The fake card processor on a free port; its URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "testproject.processor", "--port", str(port)],
        cwd=ROOT, env=unmeasured(os.environ), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url), timeout=10)
        yield url
    finally:
        process.kill()
        process.wait()


def _answers(url: str) -> bool:
    with contextlib.suppress(requests.RequestException):
        return requests.get(f"{url}/v1/stats", timeout=1).ok
    return False


def processor_stats(url: str) -> dict[str, int]:
    stats: dict[str, int] = requests.get(f"{url}/v1/stats", timeout=5).json()
    return stats


def processor_webhooks(url: str) -> dict[str, str]:
    """Per capture id, its ``charge.settled`` event's state: pending, acknowledged or
    abandoned."""
    webhooks: dict[str, str] = requests.get(f"{url}/v1/webhooks", timeout=30).json()["webhooks"]
    return webhooks


def settle_at(url: str, webhook_url: str, secret: str) -> None:
    """Have the processor at ``url`` settle its captures at ``webhook_url`` from now on
    (deliveries still being tried go there too)."""
    hook = {"url": webhook_url, "secret": secret}
    requests.post(f"{url}/v1/webhook", json=hook, timeout=10).raise_for_status()


def processor_captures(url: str) -> list[dict[str, Any]]:
    """Every capture the processor made, in order."""
    captures: list[dict[str, Any]] = requests.get(f"{url}/v1/captures", timeout=30).json()[
        "captures"
    ]
    return captures


class CeleryWorker:
    """``celery -A <app> worker`` (prefork) with its log in a file, in a process group of its
    own so that ``kill()`` takes its pool children with it. Not traced by coverage.py
    (``unmeasured``): the tasks run in forked pool children, whose measurements are lost."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        app: str = "testproject",
        concurrency: int = 2,
        log: Path | None = None,
        ready_timeout: float | None = 60,
    ) -> None:
        self.log = log or Path(tempfile.mkstemp(prefix="chain-worker-", suffix=".log")[1])
        with self.log.open("a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "prefork",
                 "-c", str(concurrency), "--loglevel", "INFO", "--without-gossip",
                 "--without-mingle", "--without-heartbeat",
                 "-n", f"chain-{uuid.uuid4().hex[:6]}@%h"],
                cwd=ROOT, env=unmeasured(env), stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent, start_new_session=True,
            )  # fmt: skip
        if ready_timeout is not None:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        wait_for(lambda: " ready." in self.text() or self.process.poll() is not None, timeout)
        assert self.process.poll() is None, self.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    def kill(self) -> None:
        """``kill -9`` of the worker and its pool children at once."""
        kill_group(self.process)

    def stop(self, unlink: bool = True) -> None:
        # kill -9 with its pool children: the test is over, and an untraced worker has no
        # coverage to save (a cold shutdown, SIGQUIT, took 1 to 2 s).
        self.kill()
        if unlink:
            self.log.unlink(missing_ok=True)


def kill_group(process: subprocess.Popen[Any]) -> None:
    """``kill -9`` of a process started with ``start_new_session`` and all its children."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
