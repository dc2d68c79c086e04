"""A private ``nats-server -js`` on a free port (``bench/nats_server.py``, shared with the
benchmarks), started as a child that dies with the test session."""

from __future__ import annotations

from pathlib import Path

from bench.nats_server import NATS_SERVER, STREAM, SUBJECTS
from bench.nats_server import NatsServer as _NatsServer
from tests.conftest import die_with_parent
from tests.support.servers import free_port

__all__ = ["NATS_SERVER", "STREAM", "SUBJECTS", "NatsServer"]


class NatsServer(_NatsServer):
    @classmethod
    def on_free_port(cls, directory: Path) -> NatsServer:
        return cls(free_port(), directory, preexec_fn=die_with_parent)
