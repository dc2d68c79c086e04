"""How hard a run pushes: the short profile runs in every test run, the long one is the proof."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerShape:
    """One gunicorn configuration the faulted traffic runs against."""

    workers: int
    threads: int = 1

    @property
    def concurrency(self) -> int:
        return self.workers * self.threads

    def describe(self) -> str:
        if self.threads == 1:
            return f"{self.workers} sync workers"
        return f"{self.workers} gthread workers x {self.threads} threads"


@dataclass(frozen=True)
class RetryPolicy:
    """What an SDK does: same key every time, exponential backoff with full jitter, and a
    read timeout shorter than the slowest handlers (``delay_ms``)."""

    connect_timeout: float = 2.0
    read_timeout: float = 3.0
    base_delay: float = 0.1
    max_delay: float = 3.0
    # One logical request gives up after this long; the recovery sweep then retries it.
    give_up_after: float = 60.0


@dataclass(frozen=True)
class Profile:
    name: str
    # Seconds of faulted traffic, split evenly over the server shapes.
    traffic_seconds: float
    shapes: tuple[ServerShape, ...]
    clients: int
    token_principals: int
    session_principals: int
    # Seconds between two injected faults (uniform), and the weight of each kind.
    fault_every: tuple[float, float]
    fault_weights: dict[str, int]
    # Share of logical requests carrying a client-triggered fault.
    crash_share: float = 0.03
    fail_share: float = 0.03
    slow_share: float = 0.03
    # Share of requests reusing another principal's key, and of successes followed by a
    # reuse of the same key for a different request (which must get 422).
    cross_principal_share: float = 0.05
    reuse_share: float = 0.03
    endpoints: dict[str, int] = field(
        default_factory=lambda: {"/api/charges/": 6, "/api/refunds/": 2, "/api/charges-django/": 2}
    )
    hot_key_clients: int = 100
    # Longer than the default 2 s a duplicate waits: some duplicates get 409 and retry.
    hot_key_delay_ms: int = 2500
    # Concurrent distinct keys per batch in the scaling measurement, and the handler delay.
    scaling_batches: tuple[int, ...] = (1, 4, 8, 16)
    scaling_delay_ms: int = 400
    cold_start_requests: int = 5
    maintenance_every: float = 8.0
    policy: RetryPolicy = field(default_factory=RetryPolicy)


FAULT_KINDS = ("worker-kill", "db-outage", "connection-cut")

PROFILES = {
    "short": Profile(
        name="short",
        traffic_seconds=35.0,
        shapes=(ServerShape(workers=4),),
        clients=10,
        token_principals=4,
        session_principals=1,
        fault_every=(1.5, 3.0),
        fault_weights={"worker-kill": 5, "db-outage": 1, "connection-cut": 3},
        hot_key_clients=100,
        maintenance_every=6.0,
    ),
    "long": Profile(
        name="long",
        traffic_seconds=32 * 60.0,
        shapes=(ServerShape(workers=4), ServerShape(workers=3, threads=4)),
        clients=16,
        token_principals=8,
        session_principals=2,
        fault_every=(3.0, 7.0),
        fault_weights={"worker-kill": 5, "db-outage": 1, "connection-cut": 3},
        hot_key_clients=300,
        maintenance_every=20.0,
    ),
}
