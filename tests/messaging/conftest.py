"""Fixtures the messaging tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.nats_server import NATS_SERVER, NatsCluster, NatsServer


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


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three private ``nats-server -js`` nodes clustered on free ports, stopped afterwards."""
    if NATS_SERVER is None:
        pytest.skip("needs nats-server (Debian: nats-server)")
    cluster = NatsCluster(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.shutdown()
