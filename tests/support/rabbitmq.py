"""A private RabbitMQ node for the reliability suite's chain profile on RabbitMQ: its own node
name, ports, epmd, Erlang cookie, mnesia directory, configuration and (no) plugins, so that it
never touches the machine's node (5672) or its epmd (4369).

Started in the foreground, in a process group of its own, so that ``kill()`` is a ``kill -9``
of the node (the broker-restart fault); ``shutdown()`` stops it with ``rabbitmqctl -n NODE
stop`` and then its epmd.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import die_with_parent
from tests.support.chain_processes import QUEUE, kill_group, wait_for

# The scripts themselves: the packaged wrappers switch to the rabbitmq user (and its cookie).
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
# Where the chain profile's nodes find their three ports (AMQP, distribution, epmd).
PORTS = range(17420, 17500)


def installed() -> bool:
    return (RABBITMQ_BIN / "rabbitmq-server").exists()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(count: int, ports: range = PORTS) -> list[int]:
    """``count`` consecutive free ports of ``ports``."""
    for start in range(ports.start, ports.stop - count + 1, count):
        chosen = list(range(start, start + count))
        if all(_free(port) for port in chosen):
            return chosen
    raise RuntimeError(f"no {count} consecutive free ports in {ports}")


@dataclass
class RabbitMQNode:
    directory: Path
    port: int
    dist_port: int
    epmd_port: int
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def on_free_ports(cls, directory: Path) -> RabbitMQNode:
        port, dist_port, epmd_port = free_ports(3)
        return cls(directory, port, dist_port, epmd_port)

    @property
    def name(self) -> str:
        return f"idem-chain-{self.port}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def log(self) -> Path:
        return self.directory / "rabbitmq.log"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            # The Erlang cookie is made in, and read from, $HOME.
            "HOME": str(self.directory),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.directory / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.directory / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.directory / "rabbitmq.pid"),
        }

    def start(self, timeout: float = 120) -> None:
        """Start the node (again, on the same mnesia directory after a kill) and wait until it
        takes AMQP connections."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "enabled_plugins").write_text("[].\n")
        (self.directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
        )
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(RABBITMQ_BIN / "rabbitmq-server")], cwd=self.directory, env=self.env(),
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                start_new_session=True,
            )  # fmt: skip
        wait_for(self.answers, timeout=timeout, every=0.2)

    def answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited with {self.process.returncode}")
        from kombu import Connection

        with contextlib.suppress(Exception), Connection(self.url, connect_timeout=1) as conn:
            conn.ensure_connection(max_retries=1)
            return True
        return False

    def ctl(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.name, *args], cwd=self.directory,
            env=self.env(), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr or done.stdout}")
        return done.stdout

    def in_flight(self, queue: str = QUEUE) -> tuple[int, int]:
        """(messages ready in ``queue``, messages delivered and not yet acknowledged)."""
        out = self.ctl("list_queues", "-q", "--no-table-headers", "name", "messages_ready",
                       "messages_unacknowledged")  # fmt: skip
        for line in out.splitlines():
            name, ready, unacked = line.split()
            if name == queue:
                return int(ready), int(unacked)
        return 0, 0

    def kill(self) -> None:
        """``kill -9`` of the node: what it confirmed is on disk already."""
        if self.process is not None:
            kill_group(self.process)
            self.process = None

    def shutdown(self) -> None:
        """Stop the node (``rabbitmqctl -n NODE stop``, else ``kill -9``), then its epmd."""
        if self.process is not None and self.process.poll() is None:
            try:
                self.ctl("stop", timeout=60)
                self.process.wait(timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired):
                kill_group(self.process)
        self.process = None
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["epmd", "-port", str(self.epmd_port), "-kill"],
                capture_output=True, timeout=10, env=self.env(),
            )  # fmt: skip
