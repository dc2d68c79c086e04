"""The cost of idempotency per HTTP request: the testproject's charge endpoint with the mixin
(a fresh key, and a replay of a stored key) against the same handler without it.

Sequential latency over one keep-alive connection (and the same with the claim first,
``lookup_first`` off, on the same server), large bodies (receipts of 1 KB to 1 MB, replayed
with and without deflate), then throughput with parallel clients whose connections are
spread evenly over the gunicorn workers. The modes are interleaved, so that drift in the
machine's load hits them alike. Round trips per mode and the time to store 1 MB come from
``bench.round_trips``.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from typing import Any

from bench.floor import (
    CLAIM_FIRST_PATH,
    FLOOR_FRESH,
    FLOOR_FRESH_STATEMENTS,
    FLOOR_REPLAY,
    FLOOR_REPLAY_STATEMENTS,
    NEW_KEY_FLOORS,
    STANDS_FOR,
    STORED_KEY_FLOORS,
)
from bench.floor import PATHS as FLOOR_PATHS
from bench.report import RESULTS_DIR, Check, Section, median, percentile
from bench.run import Options
from bench.server import (
    ROOT,
    CpuMeter,
    Gunicorn,
    SchedClock,
    backend_pids,
    django_env,
    server_version,
)

TOKEN = "a" * 40  # the demo user alice's public token (seed_demo)
BODY = json.dumps({"amount": 2499, "currency": "inr"}).encode()
PLAIN, FRESH, REPLAY = "plain", "fresh key", "replay"
MODES = (PLAIN, FRESH, REPLAY)
PATHS = {PLAIN: "/api/charges-plain/", FRESH: "/api/charges/", REPLAY: "/api/charges/"}
# How a mode sends its Idempotency-Key: none, a new one, or one whose response is stored.
NO_KEY, NEW_KEY, STORED_KEY = "none", "new", "stored"
# Keys a client keeps for replaying: replays cycle through them.
KEPT_KEYS = 2000
MAX_ERRORS_KEPT = 5
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
DEFLATED = b"\r\ncontent-encoding: deflate"
# The receipts' sizes for the large-body replays, and the mode kinds measured at each.
SIZES = {"1 KB": 1024, "100 KB": 100 * 1024, "1 MB": 1024 * 1024}
DEFLATE = "replay, deflate"
BODY_KINDS = (PLAIN, FRESH, REPLAY, DEFLATE)


@dataclass(frozen=True)
class Mode:
    """One kind of request: where, what, with which key and headers."""

    name: str
    path: str
    body: bytes
    key: str = NO_KEY
    # A mode sending new keys feeds its pool; a mode replaying cycles through it.
    pool: str = ""
    headers: bytes = b""
    # The answer's body length (after decoding), checked on every answer.
    size: int | None = None


# The same charges with lookup_first off, served beside them (bench/floor_views.py).
FRESH_FIRST, REPLAY_FIRST = "fresh key, claim first", "replay, claim first"
FIRST_MODES = (
    Mode(FRESH_FIRST, CLAIM_FIRST_PATH, BODY, NEW_KEY, "charges, claim first"),
    Mode(REPLAY_FIRST, CLAIM_FIRST_PATH, BODY, STORED_KEY, "charges, claim first"),
)
CHARGE_MODES = (
    Mode(PLAIN, PATHS[PLAIN], BODY),
    Mode(FRESH, PATHS[FRESH], BODY, NEW_KEY, "charges"),
    Mode(REPLAY, PATHS[REPLAY], BODY, STORED_KEY, "charges"),
)


def floor_mode(name: str) -> Mode:
    """A floor of bench/floor.py: a protected request's round trips, or its statements,
    without the engine. The statement floors replay the keys they stored themselves."""
    if name in NEW_KEY_FLOORS:
        return Mode(name, FLOOR_PATHS[name], BODY, NEW_KEY, "floor")
    if name in STORED_KEY_FLOORS:
        return Mode(name, FLOOR_PATHS[name], BODY, STORED_KEY, "floor")
    return Mode(name, FLOOR_PATHS[name], BODY)


FLOOR_MODES = tuple(floor_mode(name) for name in FLOOR_PATHS)
FLOORS = tuple(FLOOR_PATHS)
SEQUENTIAL_MODES = (*MODES, FRESH_FIRST, REPLAY_FIRST, *FLOORS)
# In the parallel run too: how far a fresh key's round trips alone, and its statements
# alone, let its throughput go, and the CPU each adds; and a replay's statements alone.
PARALLEL_MODES = (*MODES, FLOOR_FRESH, FLOOR_FRESH_STATEMENTS, FLOOR_REPLAY_STATEMENTS)


def body_mode(kind: str, label: str) -> str:
    return f"{kind} {label}"


def body_modes() -> list[Mode]:
    """Per size, a receipt: unprotected, with a new key, replayed, replayed to a client
    that accepts deflate."""
    modes = []
    for label, size in SIZES.items():
        body = json.dumps({"amount": 2499, "currency": "inr", "size": size}).encode()
        pool = f"receipts {label}"
        modes += [
            Mode(body_mode(PLAIN, label), "/api/receipts-plain/", body, size=size),
            Mode(body_mode(FRESH, label), "/api/receipts/", body, NEW_KEY, pool, size=size),
            Mode(body_mode(REPLAY, label), "/api/receipts/", body, STORED_KEY, pool, size=size),
            Mode(
                body_mode(DEFLATE, label),
                "/api/receipts/",
                body,
                STORED_KEY,
                pool,
                b"Accept-Encoding: deflate\r\n",
                size,
            ),
        ]
    return modes


class UnexpectedResponse(Exception):
    pass


class Client:
    """One persistent HTTP/1.1 connection on a bare socket.

    The request bytes are built once per mode and the response is parsed no further than
    its status, Content-Length, replay and encoding headers. Against a server that does
    nothing, http.client took about 165 us per request (mostly parsing headers) and this
    client about 30 us: time added to every latency pulls all the ratios toward 1.
    """

    def __init__(self, address: tuple[str, int], modes: Sequence[Mode] = CHARGE_MODES) -> None:
        self.address = address
        self.sock = self._connect()
        self.modes = {mode.name: mode for mode in modes}
        self.requests = {
            mode.name: (
                f"POST {mode.path} HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
                f"Authorization: Token {TOKEN}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(mode.body)}\r\n"
            ).encode()
            + mode.headers
            for mode in modes
        }
        self.keys: dict[str, list[str]] = defaultdict(list)
        self.replays: Counter[str] = Counter()
        self.reconnects = 0
        # Per mode: answers that came deflated, and the body bytes of the last answer on
        # the wire; the last answer's body, decoded.
        self.deflated: Counter[str] = Counter()
        self.wire_bytes: dict[str, int] = {}
        self.last_body: bytes | bytearray = b""

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
        """Make sure every pool that a mode replays from has a stored key."""
        for mode in self.modes.values():
            if mode.key == STORED_KEY and not self.keys[mode.pool]:
                feeder = next(
                    m for m in self.modes.values() if m.pool == mode.pool and m.key == NEW_KEY
                )
                self.send(feeder.name)

    def send(self, name: str) -> float:
        """One request; its latency in seconds. Raises UnexpectedResponse."""
        mode = self.modes[name]
        request = self.requests[name]
        key = None
        if mode.key == NEW_KEY:
            key = str(uuid.uuid4())
            request += b"Idempotency-Key: " + key.encode() + b"\r\n"
        elif mode.key == STORED_KEY:
            keys = self.keys[mode.pool]
            request += b"Idempotency-Key: " + keys[self.replays[mode.pool] % len(keys)].encode()
            request += b"\r\n"
            self.replays[mode.pool] += 1
        request += b"\r\n" + mode.body
        started = time.perf_counter()
        try:
            self.sock.sendall(request)
            status, head, raw = self._response()
        except OSError as exc:
            # Never expected with keep-alive on; reconnect so one failure is one error.
            self.sock.close()
            self.sock = self._connect()
            self.reconnects += 1
            raise UnexpectedResponse(f"{name}: {exc!r}") from exc
        elapsed = time.perf_counter() - started
        head = head.lower()
        replayed = b"\r\nidempotent-replayed: true" in head
        if status != 201 or replayed != (mode.key == STORED_KEY):
            raise UnexpectedResponse(f"{name}: {status} replayed={replayed} {raw[:200]!r}")
        self.wire_bytes[name] = len(raw)
        body: bytes | bytearray = raw
        if DEFLATED in head:
            if b"accept-encoding: deflate" not in mode.headers.lower():
                raise UnexpectedResponse(f"{name}: deflated for a client that did not ask")
            self.deflated[name] += 1
            body = zlib.decompress(body)
        if mode.size is not None and len(body) != mode.size:
            raise UnexpectedResponse(f"{name}: {len(body)} bytes instead of {mode.size}")
        self.last_body = body
        if key is not None:
            keys = self.keys[mode.pool]
            keys.append(key)
            if len(keys) > KEPT_KEYS:
                del keys[: len(keys) - KEPT_KEYS]
        return elapsed

    def _response(self) -> tuple[int, bytes, bytearray]:
        data = bytearray()
        while (end := data.find(b"\r\n\r\n")) < 0:
            data += self._recv()
        head = bytes(data[:end])
        match = CONTENT_LENGTH.search(head)
        if match is None:
            raise ConnectionError(f"no Content-Length in {head[:300]!r}")
        length = int(match.group(1))
        got = len(data) - end - 4
        if got > length:
            raise ConnectionError("more bytes than Content-Length: pipelining is not used")
        # Received in place: a 1 MB body appended chunk by chunk costs the client
        # milliseconds of copying, which would pull the large-body ratios toward 1.
        body = bytearray(length)
        body[:got] = data[end + 4 :]
        view = memoryview(body)
        while got < length:
            received = self.sock.recv_into(view[got:])
            if not received:
                raise ConnectionError("the server closed the connection")
            got += received
        return int(head[9:12]), head, body

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
        client.keys["charges"].append("floor")
        latencies = [client.send(REPLAY) for _ in range(requests + requests // 10)]
        client.close()
    finally:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
    return median(latencies[requests // 10 :])


@dataclass
class Tally:
    latencies: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)

    def send(self, client: Client, mode: str) -> None:
        try:
            self.latencies[mode].append(client.send(mode))
        except UnexpectedResponse as exc:
            self.errors[mode] += 1
            if len(self.samples) < MAX_ERRORS_KEPT:
                self.samples.append(str(exc))


def sequential(
    client: Client, rounds: int, rng: random.Random, modes: Sequence[str] = MODES
) -> Tally:
    """Each round sends one request per mode, in a shuffled order."""
    return interleaved([(client, modes)], rounds, rng)


def interleaved(
    clients: Sequence[tuple[Client, Sequence[str]]], rounds: int, rng: random.Random
) -> Tally:
    """Each round sends one request per mode of every client, all in a shuffled order."""
    tally = Tally()
    for client, _ in clients:
        client.prime()
    pairs = [(client, mode) for client, modes in clients for mode in modes]
    for _ in range(rounds):
        rng.shuffle(pairs)
        for client, mode in pairs:
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


def balanced_clients(
    server: Gunicorn, count: int, modes: Sequence[Mode], timeout: float = 60
) -> list[Client]:
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
        client = Client(server.address, modes)
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


def count_round_trips(options: Options) -> tuple[dict[str, Any], str | None]:
    """``bench.round_trips`` in a process of its own (it sets Django up): statements and
    round trips per mode, and the time to store a 1 MB response."""
    stores = max(10, options.requests // 10)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.round_trips"),
            *("--database-url", options.database_url, "--samples", "5"),
            *("--stores", str(stores)),
        ],
        cwd=ROOT,
        env=django_env(options.database_url),
        capture_output=True,
        text=True,
    )
    if done.returncode:
        return {}, f"bench.round_trips failed: {(done.stderr or done.stdout)[-2000:]}"
    return json.loads(done.stdout), None


@dataclass
class Bodies:
    tally: Tally
    client: Client
    # Per mode: CPU seconds of the gunicorn workers and of the database backends, summed
    # over the mode's requests.
    app_cpu: defaultdict[str, float]
    db_cpu: defaultdict[str, float]
    # Whether a replay with deflate decoded to the bytes of one without, per size.
    identical: str


def large_bodies(server: Gunicorn, url: str, rounds: int, rng: random.Random) -> Bodies:
    """Receipts of each size in every mode, interleaved on one connection, with the CPU
    time each request took in gunicorn and in PostgreSQL; and whether a replay to a client
    accepting deflate decodes to the same bytes as a plain replay."""
    client = Client(server.address, body_modes())
    client.prime()  # one key per size: the two replays below use the same one
    same = []
    for label in SIZES:
        client.send(body_mode(REPLAY, label))
        plain = bytes(client.last_body)
        client.send(body_mode(DEFLATE, label))
        deflated = client.deflated[body_mode(DEFLATE, label)] > 0
        same.append(
            f"{label} {'deflated' if deflated else 'as is'}, "
            + ("identical" if bytes(client.last_body) == plain else "DIFFERENT")
        )
    names = [m.name for m in body_modes()]
    sequential(client, max(2, rounds // 10), rng, names)  # warm-up
    workers = server.worker_pids()
    clock = SchedClock(workers + backend_pids(url))
    app_cpu: defaultdict[str, float] = defaultdict(float)
    db_cpu: defaultdict[str, float] = defaultdict(float)
    tally = Tally()
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            before = clock.read()
            tally.send(client, name)
            used = [b - a for a, b in zip(before, clock.read(), strict=True)]
            app_cpu[name] += sum(used[: len(workers)]) / 1e9
            db_cpu[name] += sum(used[len(workers) :]) / 1e9
    return Bodies(tally, client, app_cpu, db_cpu, "; ".join(same))


def run(options: Options) -> Section:
    rng = random.Random(options.seed)
    errors: list[str] = []
    floor = client_floor()
    # Before gunicorn starts: traced requests in a process of their own.
    trips, failed = count_round_trips(options)
    if failed:
        errors.append(failed)
    # A floor stands for its mode only while it makes the same round trips.
    for stand_in, mode in STANDS_FOR.items():
        counted = {
            m: trips.get("modes", {}).get(m, {}).get("round_trips") for m in (mode, stand_in)
        }
        if not failed and counted[mode] != counted[stand_in]:
            errors.append(f"round trips of {mode} and {stand_in} differ: {counted}")
    body_rounds = max(20, options.requests // 5)
    with Gunicorn(
        options.database_url, options.workers, RESULTS_DIR / "gunicorn.log", "bench.settings"
    ) as server:
        # Sequential latency: one connection, so one worker serves every mode.
        client = Client(server.address, (*CHARGE_MODES, *FIRST_MODES, *FLOOR_MODES))
        sequential(client, options.warmup, rng, SEQUENTIAL_MODES)
        cpu = time.process_time()
        seq = sequential(client, options.requests, rng, SEQUENTIAL_MODES)
        seq_cpu = (time.process_time() - cpu) / sum(len(v) for v in seq.latencies.values())
        client.close()

        found = large_bodies(server, options.database_url, body_rounds, rng)
        bodies, body_client, identical = found.tally, found.client, found.identical
        body_client.close()

        clients = balanced_clients(server, options.clients, (*CHARGE_MODES, *FLOOR_MODES))
        spread = sorted(Counter(server.worker_of(c.local_port) for c in clients).values())
        # Warm every connection's worker: its database connection and the claim
        # function's cached plan are per worker process.
        for c in clients:
            sequential(c, 10, rng, PARALLEL_MODES)
        meter = CpuMeter(server, options.database_url)
        segments: list[Segment] = []
        cpu, wall = time.process_time(), time.perf_counter()
        for repeat in range(options.repeats):
            order = PARALLEL_MODES if repeat % 2 == 0 else PARALLEL_MODES[::-1]
            segments += [parallel(clients, mode, options.duration, meter) for mode in order]
        par_cpu = (time.process_time() - cpu) / (time.perf_counter() - wall)
        reconnects = sum(c.reconnects for c in clients)
        for c in clients:
            c.close()

    tallies = [("sequential", seq), ("large bodies", bodies)]
    tallies += [(f"parallel {s.mode}", s.tally) for s in segments]
    for label, tally in tallies:
        for mode, n in tally.errors.items():
            errors.append(f"{label}: {n} unexpected answers to {mode}; e.g. {tally.samples[0]}")
    if reconnects:
        errors.append(f"{reconnects} connections were lost and reopened during the parallel run")
    if "DIFFERENT" in identical:
        errors.append(f"a replay with deflate decoded to other bytes: {identical}")

    lat = {m: [x * 1000 for x in seq.latencies[m]] for m in SEQUENTIAL_MODES}
    p50 = {m: median(lat[m]) for m in SEQUENTIAL_MODES}
    p99 = {m: percentile(lat[m], 99) for m in SEQUENTIAL_MODES}
    mine = {m: [s for s in segments if s.mode == m] for m in PARALLEL_MODES}
    tput = {m: [s.throughput for s in mine[m]] for m in PARALLEL_MODES}
    tput_median = {m: median(tput[m]) for m in PARALLEL_MODES}
    # Each repeat's cells ran next to each other: their ratio is paired against drift.
    paired = {m: [t / p for t, p in zip(tput[m], tput[PLAIN], strict=True)] for m in PARALLEL_MODES}
    requests = {m: sum(s.requests for s in mine[m]) for m in PARALLEL_MODES}
    app_us = {m: sum(s.app_cpu for s in mine[m]) / requests[m] * 1e6 for m in PARALLEL_MODES}
    db_cpu = {m: [s.db_cpu for s in mine[m] if s.db_cpu is not None] for m in PARALLEL_MODES}
    db_us = {m: sum(db_cpu[m]) / requests[m] * 1e6 if db_cpu[m] else None for m in PARALLEL_MODES}

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    modes_found: dict[str, Any] = trips.get("modes", {})

    def round_trips(mode: str) -> str:
        # Beside the ratio: what the mode's cost is made of (bench.round_trips).
        found = modes_found.get(mode)
        return "-" if found is None else str(found["round_trips"])

    rows = [
        [
            m,
            f"{p50[m]:.2f}",
            f"{p99[m]:.2f}",
            f"{p50[m] / p50[PLAIN]:.2f}x",
            round_trips(m),
            f"{p99[m] / p99[PLAIN]:.2f}x",
            *(
                [f"{tput_median[m]:.0f}", f"{median(paired[m]):.2f}x", us(app_us[m])]
                if m in PARALLEL_MODES
                else ["-", "-", "-"]
            ),
            us(db_us[m]) if m in PARALLEL_MODES else "-",
        ]
        for m in SEQUENTIAL_MODES
    ]
    header = [
        "mode",
        "p50 ms",
        "p99 ms",
        "p50 ratio",
        "round trips",
        "p99 ratio",
        f"req/s x{options.clients}",
        "req/s ratio",
        "app CPU us",
        "db CPU us",
    ]

    trip_rows = [
        [
            mode,
            str(found["statements"]),
            str(found["round_trips"]) + ("" if found["steady"] else " (varied)"),
            " | ".join(found["sent"]),
        ]
        for mode, found in modes_found.items()
    ]
    trip_header = ["mode", "statements", "round trips", "sent"]
    body_ms = {name: [x * 1000 for x in values] for name, values in bodies.latencies.items()}
    body_p50 = {name: median(values) for name, values in body_ms.items()}
    body_rows = []
    for label in SIZES:
        base = body_p50[body_mode(PLAIN, label)]
        row = [label, f"{base:.2f}"]
        for kind in (FRESH, REPLAY, DEFLATE):
            value = body_p50[body_mode(kind, label)]
            row += [f"{value:.2f}", f"{value / base:.2f}x"]
        row.append(f"{body_client.wire_bytes.get(body_mode(DEFLATE, label), 0):,}")
        body_rows.append(row)
    cpu_rows = []
    for label in SIZES:
        row = [label]
        for kind in BODY_KINDS:
            name = body_mode(kind, label)
            ms = 1000 / len(bodies.latencies[name])
            row.append(f"{found.app_cpu[name] * ms:.2f} + {found.db_cpu[name] * ms:.2f}")
        cpu_rows.append(row)
    cpu_header = ["body", *(f"{kind} ms" for kind in BODY_KINDS)]
    body_header = ["body", "plain ms", "fresh ms", "ratio", "replay ms", "ratio"]
    body_header += ["deflate ms", "ratio", "deflate bytes"]
    store: dict[str, Any] = trips.get("store_1mb", {})

    def body_ratio(kind: str) -> float:
        return body_p50[body_mode(kind, "1 MB")] / body_p50[body_mode(PLAIN, "1 MB")]

    def floor_note(trips: str, statements: str) -> str:
        return (
            f"its round trips alone {p50[trips] / p50[PLAIN]:.2f}x, its statements without "
            f"the engine {p50[statements] / p50[PLAIN]:.2f}x (bench/floor.py)"
        )

    checks = [
        Check(
            "sequential fresh key / plain, median",
            p50[FRESH] / p50[PLAIN],
            1.20,
            True,
            note=floor_note(FLOOR_FRESH, FLOOR_FRESH_STATEMENTS),
        ),
        Check(
            "sequential replay / plain, median",
            p50[REPLAY] / p50[PLAIN],
            0.65,
            True,
            note=floor_note(FLOOR_REPLAY, FLOOR_REPLAY_STATEMENTS)
            + f"; claim first {p50[REPLAY_FIRST] / p50[PLAIN]:.2f}x",
        ),
        Check(
            f"{options.clients} clients, throughput fresh key / plain",
            median(paired[FRESH]),
            0.85,
            False,
            note="median of the repeats: "
            + ", ".join(f"{r:.2f}" for r in paired[FRESH])
            + f"; its round trips alone {median(paired[FLOOR_FRESH]):.2f}x, its statements "
            f"without the engine {median(paired[FLOOR_FRESH_STATEMENTS]):.2f}x",
        ),
        Check(
            f"{options.clients} clients, throughput replay / plain",
            median(paired[REPLAY]),
            1.5,
            False,
            note="median of the repeats: "
            + ", ".join(f"{r:.2f}" for r in paired[REPLAY])
            + f"; its statements without the engine {median(paired[FLOOR_REPLAY_STATEMENTS]):.2f}x",
        ),
        Check("replay of a 1 MB body / plain, median", body_ratio(REPLAY), 1.0, True),
        Check("replay of 1 MB, deflate accepted / plain", body_ratio(DEFLATE), 1.0, True),
    ]
    if store:
        checks.append(
            Check(
                "storing a 1 MB response",
                store["total_ms"],
                8.0,
                True,
                note=f"compress {store['compress_ms']:.2f} ms + write and COMMIT "
                f"{store['write_and_commit_ms']:.2f} ms, median; CPU: app "
                f"{store['app_cpu_ms']:.2f} ms, db {store['db_cpu_ms']:.2f} ms (mean)",
                unit="ms",
            )
        )
    notes = [
        f"sequential: {options.requests} requests per mode after {options.warmup} warm-up "
        f"rounds, modes shuffled in each round, one keep-alive connection (the claim first "
        f"modes: the same charges with lookup_first=False, {CLAIM_FIRST_PATH}); parallel: "
        f"{options.clients} clients x {options.repeats} repeats x {options.duration:g}s per "
        f"mode, connections per worker {spread}; gunicorn {options.workers} gthread workers "
        f"x 1 thread; PostgreSQL {server_version(options.database_url)}",
        "floors (bench/floor.py, sequential): a protected request's round trips with "
        "SELECT 'lookup', SELECT 'claim' and SELECT 'store' in place of the lookup, the claim "
        "and the store, no engine and no record written: SELECT 'lookup', then the plain "
        "charge in BEGIN; SELECT 'claim' ... SELECT 'store'; COMMIT (a fresh key's 7); a "
        "stored charge's bytes after SELECT 'lookup' (a replay's 3); the same answer with "
        "authentication only (2); and the statement floors: the real lookup, claim and store "
        "functions through django_idempotency.storage, with the request's key and no engine "
        "(a fresh key's charge stored, then replayed)",
        "app/db CPU us: CPU time per request of the gunicorn workers and of the database's "
        "backends during the parallel run",
        f"client: {floor * 1e6:.0f} us per request against a server that does nothing "
        f"({floor * 1000 / p50[PLAIN]:.1%} of the plain median); {seq_cpu * 1e6:.0f} us CPU "
        f"per sequential request; {par_cpu:.2f} of {options.cpus} CPUs in the parallel run",
        "round trips: one traced request per mode through Django's WSGI handler, libpq "
        "trace: a round trip ends with ReadyForQuery, a statement with CommandComplete",
        f"large bodies: receipts (POST /api/receipts/ and /api/receipts-plain/), "
        f"{body_rounds} rounds of the {len(SIZES) * len(BODY_KINDS)} modes shuffled, one "
        f"keep-alive connection; medians; deflate: the client sends Accept-Encoding: "
        f"deflate (bytes on the wire in the last column, decoded and checked after timing); "
        f"replay vs replay with deflate: {identical}",
    ]
    if store:
        notes.append(
            f"storing a 1 MB response: a {store['body_bytes']:,}-byte receipt, sent as "
            f"{store['stored_bytes']:,} bytes ({store.get('encoding') or 'as it is'}; "
            f"{store.get('on_disk_bytes', 0):,} bytes on disk), written by "
            f"django_idempotency_store() with its COMMIT after a claim, in-process; median of "
            f"{len(store['total_ms_all'])}"
        )
    data = {
        "sequential_ms": lat,
        "sequential_summary": {m: {"p50": p50[m], "p99": p99[m]} for m in SEQUENTIAL_MODES},
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
        "cpu_us_per_request": {m: {"app": app_us[m], "db": db_us[m]} for m in PARALLEL_MODES},
        "client_floor_seconds": floor,
        "client_cpu_seconds_per_request": seq_cpu,
        "client_cpus_parallel": par_cpu,
        "connections_per_worker": spread,
        "round_trips": modes_found,
        "store_1mb": store,
        "large_bodies_ms": body_ms,
        "large_bodies_p50_ms": body_p50,
        "large_bodies_wire_bytes": body_client.wire_bytes,
        "large_bodies_cpu_seconds": {"app": dict(found.app_cpu), "db": dict(found.db_cpu)},
        "large_bodies_deflated_answers": dict(body_client.deflated),
        "deflate_identical": identical,
    }
    return Section(
        "Requests: testproject under gunicorn",
        header,
        rows,
        checks,
        notes,
        data,
        errors,
        tables=[
            ("Round trips per request (libpq trace)", trip_header, trip_rows),
            ("Large bodies: receipts, sequential medians", body_header, body_rows),
            ("Large bodies: CPU per request, gunicorn + PostgreSQL, mean", cpu_header, cpu_rows),
        ],
    )
