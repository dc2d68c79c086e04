"""The cost of idempotency per HTTP request: the testproject's charge endpoint with the mixin
(a fresh key, and a replay of a stored key) against the same handler without it.

Sequential latency over one keep-alive connection, then throughput with parallel clients
whose connections are spread evenly over the gunicorn workers. The modes are interleaved,
so that drift in the machine's load hits them alike.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import re
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.queues import Queue

from bench.report import RESULTS_DIR, Check, Section, median, percentile
from bench.run import Options
from bench.server import CpuMeter, Gunicorn, server_version

TOKEN = "a" * 40  # the demo user alice's public token (seed_demo)
BODY = json.dumps({"amount": 2499, "currency": "inr"}).encode()
PLAIN, FRESH, REPLAY = "plain", "fresh key", "replay"
MODES = (PLAIN, FRESH, REPLAY)
PATHS = {PLAIN: "/api/charges-plain/", FRESH: "/api/charges/", REPLAY: "/api/charges/"}
# Keys a client keeps for replaying: replays cycle through them.
KEPT_KEYS = 2000
MAX_ERRORS_KEPT = 5
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


class UnexpectedResponse(Exception):
    pass


class Client:
    """One persistent HTTP/1.1 connection on a bare socket.

    The request bytes are built once per mode and the response is parsed no further than
    its status, Content-Length and replay header. Against a server that does nothing,
    http.client took about 165 us per request (mostly parsing headers) and this client
    about 30 us: time added to every latency pulls all the ratios toward 1.
    """

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.sock = self._connect()
        head = (
            f"Host: {address[0]}:{address[1]}\r\nAuthorization: Token {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
        ).encode()
        self.requests = {mode: f"POST {PATHS[mode]} HTTP/1.1\r\n".encode() + head for mode in MODES}
        self.keys: list[str] = []
        self.replays = 0
        self.reconnects = 0

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    @property
    def local_port(self) -> int:
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()

    def prime(self) -> None:
        """Make sure there is a stored key to replay."""
        if not self.keys:
            self.send(FRESH)

    def send(self, mode: str) -> float:
        """One request; its latency in seconds. Raises UnexpectedResponse."""
        request = self.requests[mode]
        key = None
        if mode == FRESH:
            key = str(uuid.uuid4())
            request += b"Idempotency-Key: " + key.encode() + b"\r\n"
        elif mode == REPLAY:
            request += b"Idempotency-Key: " + self.keys[self.replays % len(self.keys)].encode()
            request += b"\r\n"
            self.replays += 1
        request += b"\r\n" + BODY
        started = time.perf_counter()
        try:
            self.sock.sendall(request)
            status, head, body = self._response()
        except OSError as exc:
            # Never expected with keep-alive on; reconnect so one failure is one error.
            self.sock.close()
            self.sock = self._connect()
            self.reconnects += 1
            raise UnexpectedResponse(f"{mode}: {exc!r}") from exc
        elapsed = time.perf_counter() - started
        replayed = b"\r\nidempotent-replayed: true" in head.lower()
        if status != 201 or replayed != (mode == REPLAY):
            raise UnexpectedResponse(f"{mode}: {status} replayed={replayed} {body[:200]!r}")
        if key is not None:
            self.keys.append(key)
            if len(self.keys) > KEPT_KEYS:
                del self.keys[: len(self.keys) - KEPT_KEYS]
        return elapsed

    def _response(self) -> tuple[int, bytes, bytes]:
        data = b""
        while (end := data.find(b"\r\n\r\n")) < 0:
            data += self._recv()
        head, data = data[:end], data[end + 4 :]
        match = CONTENT_LENGTH.search(head)
        if match is None:
            raise ConnectionError(f"no Content-Length in {head[:300]!r}")
        length = int(match.group(1))
        while len(data) < length:
            data += self._recv()
        if len(data) > length:
            raise ConnectionError("more bytes than Content-Length: pipelining is not used")
        return int(head[9:12]), head, data

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk


CANNED = (
    b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
    b"Idempotent-Replayed: true\r\nContent-Length: 96\r\n\r\n" + b"x" * 96
)


def _canned_server(ports: Queue[int]) -> None:
    """Answers every request on one connection with the same bytes, doing nothing else."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ports.put(listener.getsockname()[1])
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = b""
    with conn:
        while chunk := conn.recv(65536):
            data += chunk
            while (end := data.find(b"\r\n\r\n")) >= 0:
                match = CONTENT_LENGTH.search(data[:end])
                size = end + 4 + (int(match.group(1)) if match else 0)
                if len(data) < size:
                    break
                data = data[size:]
                conn.sendall(CANNED)


def client_floor(requests: int = 2000) -> float:
    """Median seconds per request of this client against a server that does nothing:
    what the client and the loopback add to every measured latency."""
    context = multiprocessing.get_context("spawn")
    ports: Queue[int] = context.Queue()
    process = context.Process(target=_canned_server, args=(ports,), daemon=True)
    process.start()
    try:
        client = Client(("127.0.0.1", ports.get(timeout=30)))
        client.keys.append("floor")
        latencies = [client.send(REPLAY) for _ in range(requests + requests // 10)]
        client.close()
    finally:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
    return median(latencies[requests // 10 :])


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    errors: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)

    def send(self, client: Client, mode: str) -> None:
        try:
            self.latencies[mode].append(client.send(mode))
        except UnexpectedResponse as exc:
            self.errors[mode] += 1
            if len(self.samples) < MAX_ERRORS_KEPT:
                self.samples.append(str(exc))


def sequential(client: Client, rounds: int, rng: random.Random) -> Tally:
    """Each round sends one request per mode, in a shuffled order."""
    tally = Tally()
    client.prime()
    for _ in range(rounds):
        order = list(MODES)
        rng.shuffle(order)
        for mode in order:
            tally.send(client, mode)
    return tally


@dataclass
class Segment:
    mode: str
    requests: int
    seconds: float
    tally: Tally
    app_cpu: float
    db_cpu: float | None

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


def parallel(clients: list[Client], mode: str, duration: float, meter: CpuMeter) -> Segment:
    """Every client sends ``mode`` requests back to back for ``duration`` seconds."""
    tallies = [Tally() for _ in clients]
    barrier = threading.Barrier(len(clients))
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(clients)

    def work(index: int) -> None:
        client, tally = clients[index], tallies[index]
        barrier.wait()
        start = time.perf_counter()
        end = start + duration
        while time.perf_counter() < end:
            tally.send(client, mode)
        spans[index] = (start, time.perf_counter())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(clients))]
    before = meter.sample()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    app_cpu, db_cpu = CpuMeter.used(before, meter.sample())
    merged = Tally()
    for tally in tallies:
        merged.latencies[mode] += tally.latencies[mode]
        merged.errors.update(tally.errors)
        merged.samples += tally.samples[: MAX_ERRORS_KEPT - len(merged.samples)]
    seconds = max(s[1] for s in spans) - min(s[0] for s in spans)
    return Segment(mode, len(merged.latencies[mode]), seconds, merged, app_cpu, db_cpu)


def balanced_clients(server: Gunicorn, count: int, timeout: float = 60) -> list[Client]:
    """``count`` connections, as evenly spread over the workers as they can be.

    A keep-alive connection stays with the worker that accepted it, and which worker
    accepts is up to the kernel: left alone, six of eight clients can land on one worker.
    """
    workers = server.worker_pids()
    quota = -(-count // len(workers))
    kept: list[Client] = []
    per_worker: Counter[int] = Counter()
    deadline = time.monotonic() + timeout
    while len(kept) < count:
        client = Client(server.address)
        client.send(PLAIN)  # the connection is accepted and served before we look
        pid = server.worker_of(client.local_port)
        if pid is not None and per_worker[pid] < quota:
            kept.append(client)
            per_worker[pid] += 1
        elif time.monotonic() > deadline:
            kept.append(client)  # better uneven than never
            per_worker[pid or 0] += 1
        else:
            client.close()
    return kept


def run(options: Options) -> Section:
    rng = random.Random(options.seed)
    errors: list[str] = []
    floor = client_floor()
    with Gunicorn(options.database_url, options.workers, RESULTS_DIR / "gunicorn.log") as server:
        # Sequential latency: one connection, so one worker.
        client = Client(server.address)
        sequential(client, options.warmup, rng)
        cpu = time.process_time()
        seq = sequential(client, options.requests, rng)
        seq_cpu = (time.process_time() - cpu) / sum(len(v) for v in seq.latencies.values())
        client.close()

        clients = balanced_clients(server, options.clients)
        spread = sorted(Counter(server.worker_of(c.local_port) for c in clients).values())
        # Warm every connection's worker: its database connection and the claim
        # function's cached plan are per worker process.
        for c in clients:
            sequential(c, 10, rng)
        meter = CpuMeter(server, options.database_url)
        segments: list[Segment] = []
        cpu, wall = time.process_time(), time.perf_counter()
        for repeat in range(options.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            segments += [parallel(clients, mode, options.duration, meter) for mode in order]
        par_cpu = (time.process_time() - cpu) / (time.perf_counter() - wall)
        reconnects = sum(c.reconnects for c in clients)
        for c in clients:
            c.close()

    for label, tally in [("sequential", seq)] + [(f"parallel {s.mode}", s.tally) for s in segments]:
        for mode, n in tally.errors.items():
            errors.append(f"{label}: {n} unexpected answers to {mode}; e.g. {tally.samples[0]}")
    if reconnects:
        errors.append(f"{reconnects} connections were lost and reopened during the parallel run")

    lat = {m: [x * 1000 for x in seq.latencies[m]] for m in MODES}
    p50 = {m: median(lat[m]) for m in MODES}
    p99 = {m: percentile(lat[m], 99) for m in MODES}
    mine = {m: [s for s in segments if s.mode == m] for m in MODES}
    tput = {m: [s.throughput for s in mine[m]] for m in MODES}
    tput_median = {m: median(tput[m]) for m in MODES}
    # Each repeat's cells ran next to each other: their ratio is paired against drift.
    paired = {m: [t / p for t, p in zip(tput[m], tput[PLAIN], strict=True)] for m in MODES}
    requests = {m: sum(s.requests for s in mine[m]) for m in MODES}
    app_us = {m: sum(s.app_cpu for s in mine[m]) / requests[m] * 1e6 for m in MODES}
    db_cpu = {m: [s.db_cpu for s in mine[m] if s.db_cpu is not None] for m in MODES}
    db_us = {m: sum(db_cpu[m]) / requests[m] * 1e6 if db_cpu[m] else None for m in MODES}

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    rows = [
        [
            m,
            f"{p50[m]:.2f}",
            f"{p99[m]:.2f}",
            f"{p50[m] / p50[PLAIN]:.2f}x",
            f"{p99[m] / p99[PLAIN]:.2f}x",
            f"{tput_median[m]:.0f}",
            f"{median(paired[m]):.2f}x",
            us(app_us[m]),
            us(db_us[m]),
        ]
        for m in MODES
    ]
    header = [
        "mode",
        "p50 ms",
        "p99 ms",
        "p50 ratio",
        "p99 ratio",
        f"req/s x{options.clients}",
        "req/s ratio",
        "app CPU us",
        "db CPU us",
    ]
    checks = [
        Check("sequential fresh key / plain, median", p50[FRESH] / p50[PLAIN], 1.10, True),
        Check("sequential fresh key / plain, p99", p99[FRESH] / p99[PLAIN], 1.10, True),
        Check("sequential replay / plain, median", p50[REPLAY] / p50[PLAIN], 0.50, True),
        Check("sequential replay / plain, p99", p99[REPLAY] / p99[PLAIN], 0.50, True),
        Check(
            f"{options.clients} clients, throughput fresh key / plain",
            median(paired[FRESH]),
            0.90,
            False,
            note="median of the repeats: " + ", ".join(f"{r:.2f}" for r in paired[FRESH]),
        ),
    ]
    notes = [
        f"sequential: {options.requests} requests per mode after {options.warmup} warm-up "
        f"rounds, modes shuffled in each round, one keep-alive connection; parallel: "
        f"{options.clients} clients x {options.repeats} repeats x {options.duration:g}s per "
        f"mode, connections per worker {spread}; gunicorn {options.workers} gthread workers "
        f"x 1 thread; PostgreSQL {server_version(options.database_url)}",
        "app/db CPU us: CPU time per request of the gunicorn workers and of the database's "
        "backends during the parallel run",
        f"client: {floor * 1e6:.0f} us per request against a server that does nothing "
        f"({floor * 1000 / p50[PLAIN]:.1%} of the plain median); {seq_cpu * 1e6:.0f} us CPU "
        f"per sequential request; {par_cpu:.2f} of {options.cpus} CPUs in the parallel run",
    ]
    data = {
        "sequential_ms": lat,
        "sequential_summary": {m: {"p50": p50[m], "p99": p99[m]} for m in MODES},
        "parallel": [
            {
                "mode": s.mode,
                "requests": s.requests,
                "seconds": s.seconds,
                "throughput": s.throughput,
                "app_cpu": s.app_cpu,
                "db_cpu": s.db_cpu,
                "p50_ms": median(s.tally.latencies[s.mode]) * 1000,
                "p99_ms": percentile(s.tally.latencies[s.mode], 99) * 1000,
            }
            for s in segments
        ],
        "cpu_us_per_request": {m: {"app": app_us[m], "db": db_us[m]} for m in MODES},
        "client_floor_seconds": floor,
        "client_cpu_seconds_per_request": seq_cpu,
        "client_cpus_parallel": par_cpu,
        "connections_per_worker": spread,
    }
    return Section(
        "Requests: testproject under gunicorn", header, rows, checks, notes, data, errors
    )
