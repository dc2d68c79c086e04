"""A private ``nats-server -js`` on a free port (``bench/nats_server.py``, shared with the
benchmarks), started as a child that dies with the test session; and a cluster of three."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from bench.nats_server import NATS_SERVER, STREAM, SUBJECTS
from bench.nats_server import NatsServer as _NatsServer
from tests.conftest import die_with_parent
from tests.support.servers import free_port

__all__ = ["NATS_SERVER", "STREAM", "SUBJECTS", "NatsCluster", "NatsServer"]


class NatsServer(_NatsServer):
    @classmethod
    def on_free_port(cls, directory: Path) -> NatsServer:
        return cls(free_port(), directory, preexec_fn=die_with_parent)


class NatsCluster:
    """Three ``nats-server -js`` nodes clustered on loopback (JetStream clustered: a stream
    of three replicas takes a publish once two of them stored it), each with its own store;
    their logs in one file, each line naming its process."""

    NODES = 3

    def __init__(self, directory: Path, ports: list[int] | None = None) -> None:
        self.directory = directory
        ports = ports or [free_port() for _ in range(2 * self.NODES)]
        clients, routes = ports[: self.NODES], ports[self.NODES :]
        cluster = ",".join(f"nats://127.0.0.1:{port}" for port in routes)
        self.nodes = [
            NatsServer(
                clients[n], directory / f"node-{n}", preexec_fn=die_with_parent,
                options=("--server_name", f"n{n}", "--cluster_name", "chain",
                         "--cluster", f"nats://127.0.0.1:{routes[n]}", "--routes", cluster),
                log_name="../nats.log",
            )
            for n in range(self.NODES)
        ]  # fmt: skip
        for node in self.nodes:
            node.directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated."""
        return ",".join(self.servers)

    @property
    def servers(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def log(self) -> Path:
        return self.directory / "nats.log"

    def start(self, timeout: float = 30) -> int:
        """Start the nodes that are down (at first all three: JetStream answers only once a
        quorum elected its leader), each on its store; how many were."""
        down = [node for node in self.nodes if not node.running()]
        for node in down:
            node.spawn()
        for node in down:
            node.wait_answering(timeout)
        return len(down)

    def shutdown(self) -> None:
        for node in self.nodes:
            node.stop()

    def add_stream(
        self, name: str = STREAM, subjects: list[str] = SUBJECTS, duplicate_window: float = 120
    ) -> None:
        """A stream of one replica per node."""
        self._any(lambda node: node.add_stream(name, subjects, duplicate_window, self.NODES))

    def leader(self, stream: str = STREAM) -> NatsServer:
        """The node that leads ``stream`` now."""

        async def read(js: Any) -> str:
            return str((await js.stream_info(stream)).cluster.leader)

        name = self._any(lambda node: node._call(read))
        return self.nodes[int(name.removeprefix("n"))]

    def ids(self, stream: str = STREAM) -> Any:
        return self._any(lambda node: node.ids(stream))

    def consumer_info(self, durable: str, stream: str = STREAM) -> Any:
        return self._any(lambda node: node.consumer_info(durable, stream))

    def _any(self, ask: Any, timeout: float = 30) -> Any:
        """``ask(node)`` of the first running node that answers, asked again until
        ``timeout``: on a busy machine a cluster just started can take seconds to elect the
        leader that JetStream answers through."""
        deadline = time.monotonic() + timeout
        while True:
            for node in self.nodes:
                if node.running():
                    with contextlib.suppress(Exception):
                        return ask(node)
            if time.monotonic() > deadline:
                raise RuntimeError("no node of the NATS cluster answered")
            time.sleep(0.2)
