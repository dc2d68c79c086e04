"""The demo's side-effect chain: the fake card processor, a broker, a Celery worker and the
outbox relay, as processes next to gunicorn (``manage.py demo``).

The broker is ``CELERY_BROKER_URL`` when set, else a private ``redis-server`` when one is
installed, else kombu's filesystem transport in a temporary directory (also with
``DEMO_BROKER=filesystem``), so the demo needs nothing installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import testproject

REPO_ROOT = Path(testproject.__file__).resolve().parent.parent
STARTUP_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Chain:
    """The chain's processes; ``env`` is what gunicorn needs to use them."""

    env: dict[str, str] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    note: str = ""
    directory: str | None = None

    @property
    def running(self) -> bool:
        return bool(self.env)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def _broker(chain: Chain) -> str:
    url = os.environ.get("CELERY_BROKER_URL", "")
    if url and not url.startswith("memory://"):
        return url
    if shutil.which("redis-server") is None or os.environ.get("DEMO_BROKER") == "filesystem":
        # kombu's filesystem transport: a directory that the relay writes messages into and
        # the worker reads them from; nothing to install.
        chain.directory = tempfile.mkdtemp(prefix="demo-broker-")
        os.environ["CELERY_BROKER_FOLDER"] = chain.directory
        return "filesystem://"
    # A private redis-server: never the machine's, and gone with the demo.
    port = free_port()
    chain.directory = tempfile.mkdtemp(prefix="demo-redis-")
    chain.processes.append(
        subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                chain.directory,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    return f"redis://127.0.0.1:{port}/0"


def _wait(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {STARTUP_TIMEOUT:.0f} s")


def start(*, quiet: bool, webhook_url: str = "") -> Chain:
    """Start the processor, a broker, the worker and the relay; without Celery nothing
    starts, ``note`` says so, and charges are not captured."""
    chain = Chain()
    if importlib.util.find_spec("celery") is None:
        chain.note = "Celery is not installed (the celery extra): no processor, ledger or relay."
        return chain
    broker = _broker(chain)
    output = subprocess.DEVNULL if quiet else None
    port = free_port()
    from django.conf import settings

    # The processor signs its charge.settled webhooks with the secret the receiver checks.
    secret = getattr(settings, "PAYMENTS_WEBHOOK_SECRET", "")
    processor = subprocess.Popen(
        [sys.executable, "-m", "testproject.processor", "--port", str(port),
         "--webhook-url", webhook_url, "--webhook-secret", secret],
        cwd=REPO_ROOT, stdout=output, stderr=output,
    )  # fmt: skip
    chain.processes.append(processor)
    processor_url = f"http://127.0.0.1:{port}"
    _wait(f"{processor_url}/v1/stats", processor)
    chain.env = {"PAYMENTS_PROCESSOR_URL": processor_url, "CELERY_BROKER_URL": broker}
    env = {**os.environ, **chain.env}
    chain.processes.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "testproject",
                "worker",
                "-P",
                "prefork",
                "-c",
                "2",
                "--loglevel",
                "WARNING" if quiet else "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=output,
            stderr=output,
        )
    )
    chain.processes.append(
        subprocess.Popen(
            [sys.executable, "manage.py", "idempotency_relay"],
            cwd=REPO_ROOT,
            env=env,
            stdout=output,
            stderr=output,
        )
    )
    chain.note = (
        f"Processor on {processor_url}, broker {broker.split('@')[-1]}, a Celery worker and "
        "the outbox relay (manage.py idempotency_relay) are running."
    )
    return chain


def wait_for_chain(
    base_url: str, ledger_rows: int = 0, settlements: int = 0, timeout: float = STARTUP_TIMEOUT
) -> dict[str, Any]:
    """The chain's counts once there are that many ledger rows and settlements (or the last
    counts seen)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{base_url}/api/charges/chain/", timeout=5) as response:
            counts: dict[str, Any] = json.loads(response.read())
        done = counts["ledger_rows"] >= ledger_rows and counts["settlements"] >= settlements
        if done or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)
