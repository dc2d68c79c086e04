"""Fixtures the messaging tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.nats_server import NATS_SERVER, NatsServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A private ``nats-server -js`` on a free port, stopped afterwards."""
    if NATS_SERVER is None:
        pytest.skip("needs nats-server (Debian: nats-server)")
    server = NatsServer.on_free_port(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
