"""A private ``nats-server -js`` on a free port (never the machine's 4222), with what the
benchmarks and the tests ask of it: streams, publishes, and the messages a stream holds.
(``tests/support/nats_server.py`` starts it as a child that dies with the test session.)"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.server import free_port

NATS_SERVER = shutil.which("nats-server") or (
    "/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None
)
STREAM = "OUTBOX"
SUBJECTS = ["outbox.>"]


async def _quiet(error: Exception) -> None:
    """Polled before it listens: a refused connection is the expected answer then."""


@dataclass
class NatsServer:
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    # For the child process: the tests make it die with their session.
    preexec_fn: Callable[[], None] | None = None
    # More options (a cluster node's), and the log file's name in ``directory``.
    options: tuple[str, ...] = ()
    log_name: str = "nats.log"

    @classmethod
    def on_free_port(cls, directory: Path) -> NatsServer:
        return cls(free_port(), directory)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20) -> None:
        """Start it (again, on the same store) and wait until JetStream answers."""
        self.spawn()
        self.wait_answering(timeout)

    def spawn(self) -> None:
        assert NATS_SERVER is not None, "needs nats-server (Debian: nats-server)"
        self.process = subprocess.Popen(
            [NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", str(self.port),
             "-sd", str(self.directory / "store"), "-l", str(self.directory / self.log_name),
             *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=self.preexec_fn,
            start_new_session=True,
        )  # fmt: skip

    def wait_answering(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server on port {self.port} did not start")
            time.sleep(0.1)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """``kill -9``."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def answers(self) -> bool:
        async def ask() -> bool:
            import nats

            client = await nats.connect(
                self.url, allow_reconnect=False, connect_timeout=1, error_cb=_quiet
            )
            try:
                await client.jetstream().account_info()
                return True
            finally:
                await client.close()

        try:
            return asyncio.run(ask())
        except Exception:
            return False

    def _call(self, work: Any) -> Any:
        async def run() -> Any:
            import nats

            client = await nats.connect(self.url, allow_reconnect=False, connect_timeout=2)
            try:
                return await work(client.jetstream())
            finally:
                await client.close()

        return asyncio.run(run())

    def add_stream(
        self,
        name: str = STREAM,
        subjects: list[str] = SUBJECTS,
        duplicate_window: float = 120,
        replicas: int = 1,
    ) -> None:
        async def add(js: Any) -> None:
            await js.add_stream(
                name=name, subjects=subjects, duplicate_window=duplicate_window,
                num_replicas=replicas,
            )  # fmt: skip

        self._call(add)

    def purge(self, stream: str = STREAM) -> None:
        async def purge(js: Any) -> None:
            await js.purge_stream(stream)

        self._call(purge)

    def count(self, stream: str = STREAM) -> int:
        """How many messages the stream holds."""

        async def read(js: Any) -> int:
            return int((await js.stream_info(stream)).state.messages)

        result: int = self._call(read)
        return result

    def publish(self, subject: str, data: bytes, message_id: str | None = None) -> int:
        """Publish to the stream, with ``message_id`` as ``Nats-Msg-Id``; the stream sequence
        (that of the first copy when the stream dropped this one as a duplicate)."""

        async def send(js: Any) -> int:
            headers = {"Nats-Msg-Id": message_id} if message_id else None
            return int((await js.publish(subject, data, headers=headers)).seq)

        result: int = self._call(send)
        return result

    def ids(self, stream: str = STREAM) -> Counter[str]:
        """How many messages the stream holds under each ``Nats-Msg-Id``."""

        async def read(js: Any) -> Counter[str]:
            info = await js.stream_info(stream)
            found: Counter[str] = Counter()
            for sequence in range(info.state.first_seq, info.state.last_seq + 1):
                message = await js.get_msg(stream, sequence)
                found[(message.headers or {}).get("Nats-Msg-Id", "")] += 1
            return found

        result: Counter[str] = self._call(read)
        return result

    def message(self, sequence: int, stream: str = STREAM) -> Any:
        async def read(js: Any) -> Any:
            return await js.get_msg(stream, sequence)

        return self._call(read)

    def consumer_info(self, durable: str, stream: str = STREAM) -> Any:
        async def read(js: Any) -> Any:
            return await js.consumer_info(stream, durable)

        return self._call(read)
