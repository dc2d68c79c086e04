"""The benchmark's database and the testproject under gunicorn."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
# Its own database on the chosen server: the demo's and the tests' data stay out of the
# figures, and the benchmark's rows stay out of theirs.
DATABASE = "idempotency_bench"


def database_url(explicit: str | None, reset: bool = False, name: str = DATABASE) -> str:
    """``explicit`` as given, else the database ``name`` (created if missing, recreated if
    ``reset``) on the server of ``DATABASE_URL``, or on the embedded server when that is
    unset."""
    if explicit:
        return explicit
    sys.path.insert(0, str(ROOT))
    from testproject.database import database_url as server_url

    base = server_url()
    url = urlunsplit(urlsplit(base)._replace(path=f"/{name}"))
    with psycopg.connect(base, autocommit=True) as conn:
        if reset:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    return url


def django_env(url: str) -> dict[str, str]:
    env = dict(os.environ, DATABASE_URL=url, DJANGO_SETTINGS_MODULE="testproject.settings")
    # DEBUG keeps every query in memory and renders errors as pages: never measure that.
    env.pop("DJANGO_DEBUG", None)
    # The testproject logs every replay at INFO; the sink's cost is the project's choice.
    env.setdefault("IDEMPOTENCY_LOG_LEVEL", "WARNING")
    return env


def prepare(url: str) -> None:
    """Migrate the benchmark database and create the demo users and tokens."""
    for command in (["migrate", "--noinput"], ["seed_demo"]):
        done = subprocess.run(
            [sys.executable, "manage.py", *command],
            cwd=ROOT,
            env=django_env(url),
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"manage.py {' '.join(command)} failed:\n{done.stdout}{done.stderr}")


def server_version(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Gunicorn:
    """``gunicorn testproject.wsgi`` on a free local port, stopped on exit.

    The gthread worker with one thread: the sync worker closes every connection after one
    response, and reconnecting would put a TCP handshake into every measured request.
    """

    def __init__(
        self, url: str, workers: int, log: Path, settings: str = "testproject.settings"
    ) -> None:
        self.url = url
        self.settings = settings
        self.log = log
        self.workers = workers
        self.host = "127.0.0.1"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Gunicorn:
        self.log.parent.mkdir(exist_ok=True)
        with self.log.open("wb") as log:
            self.process = self._start(log)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "testproject.wsgi",
                "--workers",
                str(self.workers),
                "--worker-class",
                "gthread",
                "--threads",
                "1",
                # Idle connections must survive the gaps between measured segments.
                "--keep-alive",
                "600",
                "--bind",
                f"{self.host}:{self.port}",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env={**django_env(self.url), "DJANGO_SETTINGS_MODULE": self.settings},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"gunicorn exited with status {self.process.returncode}; see {self.log}"
                )
            if len(self.worker_pids()) == self.workers:
                try:
                    conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
                    conn.request("GET", "/api/charges/count/")
                    if conn.getresponse().status == 200:
                        conn.close()
                        return
                except OSError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn did not answer on port {self.port} within {timeout}s")

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def worker_pids(self) -> list[int]:
        assert self.process is not None
        return [child.pid for child in psutil.Process(self.process.pid).children()]

    def worker_of(self, client_port: int) -> int | None:
        """The worker holding the server end of the client's connection."""
        for pid in self.worker_pids():
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == client_port:
                    return pid
        return None


class CpuMeter:
    """CPU seconds used by the gunicorn workers and by the PostgreSQL backends serving the
    benchmark's database.

    Per request, these say where the time of a saturated machine goes, whatever else the
    machine runs. A server on another machine is measured as ``None``.
    """

    def __init__(self, server: Gunicorn, url: str) -> None:
        self.workers = [psutil.Process(pid) for pid in server.worker_pids()]
        self.url = url

    @staticmethod
    def _times(pids: list[int]) -> dict[int, float]:
        times = {}
        for pid in pids:
            try:
                cpu = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue  # exited, or not on this machine
            times[pid] = cpu.user + cpu.system
        return times

    def sample(self) -> tuple[dict[int, float], dict[int, float]]:
        with psycopg.connect(self.url) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchall()
        return self._times([w.pid for w in self.workers]), self._times([r[0] for r in rows])

    @staticmethod
    def used(
        before: tuple[dict[int, float], dict[int, float]],
        after: tuple[dict[int, float], dict[int, float]],
    ) -> tuple[float, float | None]:
        """App and database CPU seconds between two samples."""

        def delta(a: dict[int, float], b: dict[int, float]) -> float:
            return sum(t - a.get(pid, 0.0) for pid, t in b.items() if pid in a)

        return delta(before[0], after[0]), delta(before[1], after[1]) if after[1] else None


def backend_pids(url: str) -> list[int]:
    """The PostgreSQL backends serving the database of ``url`` on this machine (other than
    the one asking); none when the server runs elsewhere."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        ).fetchall()
    pids = []
    for (pid,) in rows:
        try:
            # A pid of a server elsewhere may name some other process here.
            if Path(f"/proc/{pid}/comm").read_text().strip() == "postgres":
                pids.append(int(pid))
        except OSError:
            continue
    return pids


class SchedClock:
    """CPU time of processes, all their threads, to the nanosecond: the first field of
    ``/proc/<pid>/task/<tid>/schedstat``. psutil's ``cpu_times()`` counts 10 ms ticks, too
    coarse for one request."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def read(self) -> list[int]:
        """Nanoseconds of CPU per process, in the order of ``pids``."""
        totals = []
        for pid in self.pids:
            total = 0
            for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
                try:
                    total += int(stat.read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    continue  # a thread that just ended
            totals.append(total)
        return totals
