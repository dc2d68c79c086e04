"""The demo's side-effect chain: the fake card processor, a broker, a Celery worker and the
outbox relay, as processes next to gunicorn (``manage.py demo``), each started again when it
dies, as systemd or Kubernetes would, and said so on the console.

The broker is ``CELERY_BROKER_URL`` when set, else a private ``redis-server`` when one is
installed, else kombu's filesystem transport in a temporary directory (also with
``DEMO_BROKER=filesystem``), so the demo needs nothing installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
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


# A process that dies sooner than this after its start is started again after a pause that
# doubles (up to MAX_PAUSE): one that cannot start does not spin.
QUICK_EXIT = 5.0
MAX_PAUSE = 30.0
# How often the supervisor looks at its processes.
SUPERVISE_EVERY = 0.5


def fault_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The fault switches' setting for the demo's processes: on unless the environment says
    otherwise, for gunicorn (the request's switches) and the Celery worker (the ledger
    task's) alike."""
    return {"PAYMENTS_FAULTS_ENABLED": env.get("PAYMENTS_FAULTS_ENABLED", "1")}


@dataclass
class Supervised:
    """One of the chain's processes, and how to start it again."""

    name: str
    spawn: Callable[[], subprocess.Popen[bytes]]
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    pause: float = 0.0
    # When it may be started again (monotonic), once found dead.
    due: float | None = None


def exit_description(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} (killed by {signal.Signals(-code).name})"
    return f"code {code}"


@dataclass
class Chain:
    """The chain's processes, started again when one dies; ``env`` is what gunicorn needs to
    use them."""

    env: dict[str, str] = field(default_factory=dict)
    supervised: list[Supervised] = field(default_factory=list)
    note: str = ""
    directory: str | None = None
    say: Callable[[str], None] = print
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def running(self) -> bool:
        return bool(self.env)

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [one.process for one in self.supervised]

    def add(self, name: str, spawn: Callable[[], subprocess.Popen[bytes]]) -> Supervised:
        one = Supervised(name, spawn, spawn())
        self.supervised.append(one)
        return one

    def find(self, name: str) -> Supervised:
        return next(one for one in self.supervised if one.name == name)

    def supervise(self) -> None:
        """Start the thread that starts a process again when it exits."""
        self._thread = threading.Thread(target=self._watch, name="demo-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopping.wait(SUPERVISE_EVERY):
            with self._lock:
                for one in self.supervised:
                    self._look_after(one)

    def _look_after(self, one: Supervised) -> None:
        code = one.process.poll()
        if code is None or self._stopping.is_set():
            return
        now = time.monotonic()
        if one.due is None:
            lived = now - one.started
            one.pause = min(max(one.pause * 2, 1.0), MAX_PAUSE) if lived < QUICK_EXIT else 0.0
            one.due = now + one.pause
            later = f" in {one.pause:.0f} s" if one.pause else ""
            self.say(
                f"The demo's {one.name} (pid {one.process.pid}) exited with "
                f"{exit_description(code)} after {lived:.1f} s; starting it again{later}."
            )
        if now < one.due:
            return
        try:
            one.process = one.spawn()
        except OSError as exc:  # tried again after the next pause
            one.started, one.due = now, None
            self.say(f"The demo's {one.name} could not be started again: {exc}")
            return
        one.started, one.due = now, None
        one.restarts += 1
        self.say(f"The demo's {one.name} is running again (pid {one.process.pid}).")

    def unsupervise(self) -> None:
        """Start nothing again: the demo is stopping (Ctrl-C reaches every process)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        self.unsupervise()
        with self._lock:
            processes = self.processes
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def _broker(chain: Chain, env: Mapping[str, str]) -> str:
    url = env.get("CELERY_BROKER_URL", "")
    if url and not url.startswith("memory://"):
        return url
    if shutil.which("redis-server") is None or env.get("DEMO_BROKER") == "filesystem":
        # kombu's filesystem transport: a directory that the relay writes messages into and
        # the worker reads them from; nothing to install.
        chain.directory = tempfile.mkdtemp(prefix="demo-broker-")
        chain.env["CELERY_BROKER_FOLDER"] = chain.directory
        return "filesystem://"
    # A private redis-server: never the machine's, and gone with the demo.
    port = free_port()
    chain.directory = tempfile.mkdtemp(prefix="demo-redis-")
    redis = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", chain.directory]  # fmt: skip
    chain.add("broker (redis-server)", _spawner(redis, env, subprocess.DEVNULL))
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


PROCESSOR, WORKER, RELAY = (
    "card processor (python -m testproject.processor)",
    "Celery worker",
    "relay (manage.py idempotency_relay)",
)


def start(
    *,
    quiet: bool,
    webhook_url: str = "",
    say: Callable[[str], None] = print,
    env: Mapping[str, str] | None = None,
) -> Chain:
    """Start the processor, a broker, the worker and the relay, each started again when it
    dies (``say`` tells); without Celery nothing starts, ``note`` says so, and charges are not
    captured. ``env``: the processes' environment (default: this process's)."""
    chain = Chain(say=say)
    if importlib.util.find_spec("celery") is None:
        chain.note = "Celery is not installed (the celery extra): no processor, ledger or relay."
        return chain
    base = dict(os.environ if env is None else env)
    try:
        return _start(chain, base, quiet=quiet, webhook_url=webhook_url)
    except BaseException:
        chain.stop()
        raise


def _start(chain: Chain, base: dict[str, str], *, quiet: bool, webhook_url: str) -> Chain:
    broker = _broker(chain, base)
    output = subprocess.DEVNULL if quiet else None
    port = free_port()
    from django.conf import settings

    # The processor signs its charge.settled webhooks with the secret the receiver checks.
    secret = getattr(settings, "PAYMENTS_WEBHOOK_SECRET", "")
    processor = [sys.executable, "-m", "testproject.processor", "--port", str(port),
                 "--webhook-url", webhook_url, "--webhook-secret", secret]  # fmt: skip
    started = chain.add(PROCESSOR, _spawner(processor, base, output))
    processor_url = f"http://127.0.0.1:{port}"
    _wait(f"{processor_url}/v1/stats", started.process)
    chain.env.update(
        {"PAYMENTS_PROCESSOR_URL": processor_url, "CELERY_BROKER_URL": broker, **fault_env(base)}
    )
    # The worker honours the ledger task's fault switches that a charge passes on.
    env = {**base, **chain.env}
    worker = [sys.executable, "-m", "celery", "-A", "testproject", "worker", "-P", "prefork",
              "-c", "2", "--loglevel", "WARNING" if quiet else "INFO", "--without-gossip",
              "--without-mingle", "--without-heartbeat"]  # fmt: skip
    relay = [sys.executable, "manage.py", "idempotency_relay"]
    chain.add(WORKER, _spawner(worker, env, output))
    chain.add(RELAY, _spawner(relay, env, output))
    chain.supervise()
    chain.note = (
        f"Processor on {processor_url}, broker {broker.split('@')[-1]}, a Celery worker and "
        "the outbox relay (manage.py idempotency_relay) are running; one that dies is started "
        "again."
    )
    return chain


def _spawner(
    command: list[str], env: Mapping[str, str], output: int | None
) -> Callable[[], subprocess.Popen[bytes]]:
    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=output)

    return spawn


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
