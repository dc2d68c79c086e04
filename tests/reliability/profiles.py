"""How hard a run pushes: the short profile runs in every test run (every kind of fault,
attack and deployment shape once, back to back, in about 30 s), the long one is the proof;
the chain profiles take the side-effect chain beyond the request (processor, outbox, relays,
Celery workers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerShape:
    """One gunicorn configuration the faulted traffic runs against."""

    workers: int
    threads: int = 1
    # The app's connections go through a private PgBouncer in transaction pooling mode.
    pgbouncer: bool = False

    @property
    def concurrency(self) -> int:
        return self.workers * self.threads

    def describe(self) -> str:
        through = " through PgBouncer (transaction pooling)" if self.pgbouncer else ""
        if self.threads == 1:
            return f"{self.workers} sync workers{through}"
        return f"{self.workers} gthread workers x {self.threads} threads{through}"


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
class ChainShape:
    """The side-effect chain beside the app servers (the chain profiles): the fake card
    processor, the destination's private broker and consumers (``chain_destinations.py``:
    Celery on a redis-server by default), relays, and the faults made to them."""

    # A name of chain_destinations.DESTINATIONS.
    destination: str = "celery-redis"
    relays: int = 2
    workers: int = 2
    concurrency: int = 2
    # Seconds between two injected chain faults (uniform), and the weight of each kind.
    fault_every: tuple[float, float] = (2.0, 5.0)
    fault_weights: dict[str, int] = field(
        default_factory=lambda: {
            "relay-kill": 2,
            "relay-kill between publish and mark": 2,
            "consumer-kill": 2,
            "consumer-child-kill": 2,
            "broker-restart": 1,
        }
    )
    # How long the broker stays down when it is restarted.
    broker_down_seconds: tuple[float, float] = (0.2, 1.5)
    # The recovery waits this long at most for the outbox and the queue to empty.
    drain_timeout: float = 180.0
    # The processor settles each capture by its signed webhook (delivered until answered 2xx,
    # then once more), and every committed charge must be settled exactly once.
    settle: bool = False

    def describe(self) -> str:
        from tests.reliability.chain_destinations import DESTINATIONS

        destination = DESTINATIONS[self.destination]
        children = f" of {self.concurrency} children each" if destination.pooled else ""
        return (
            f"{self.relays} relays (manage.py idempotency_relay); destination "
            f"{self.destination}: {destination.description}, "
            f"{self.workers} consumer processes{children}; the fake card processor"
            + (", settling each capture by its signed webhook, delivered twice" * self.settle)
        )


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
    # How a database outage is made (pg_ctl's stop modes, on a private cluster) and how
    # long the database stays away.
    outage_modes: tuple[str, ...] = ("fast", "immediate")
    outage_seconds: tuple[float, float] = (0.2, 2.0)
    # Share of logical requests carrying a client-triggered fault; each kind is also sent
    # at least once per faulted-traffic phase.
    crash_share: float = 0.03
    fail_share: float = 0.03
    slow_share: float = 0.03
    # A slow handler outlasts the client's read timeout by this much (uniform).
    slow_extra_seconds: tuple[float, float] = (0.3, 1.5)
    # Writes, marks the transaction for rollback and answers 201 (must become a 500); and
    # a response that sets a cookie (a replay must never carry it).
    rollback_share: float = 0.02
    cookie_share: float = 0.03
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
    # How long the hot key's clients wait for an answer (None: the retry policy's read
    # timeout): the phase is about one execution under contention, not client timeouts.
    hot_key_read_timeout: float | None = None
    # Concurrent distinct keys per batch in the scaling measurement, and the handler delay.
    scaling_batches: tuple[int, ...] = (1, 4, 8, 16)
    scaling_delay_ms: int = 400
    cold_start_requests: int = 5
    maintenance_every: float = 8.0
    # Clients still retrying this long after the traffic's end are left to the recovery.
    stragglers_seconds: float = 15.0
    # The waiting-duplicate flood: duplicates with "Prefer: wait=10" on one slow charge,
    # against a threaded server whose processes let at most flood_max_waiters wait.
    flood_duplicates: int = 16
    flood_delay_ms: int = 3000
    flood_shape: ServerShape = ServerShape(workers=2, threads=4)
    flood_max_waiters: int = 2
    # The deployment shapes of issue 22 (shapes.py): the slow charge that the
    # repeatable-read database's duplicates wait behind and that the second app server's
    # duplicate arrives during, and how many duplicates wait on the repeatable-read one.
    shape_delay_ms: int = 3000
    shape_duplicates: int = 5
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    # The chain profiles: the processes of the side-effect chain and their faults; and the
    # share of charges whose ledger task is killed mid-task, killed after its commit and
    # before its ack, or outlasts Redis' visibility timeout (slow_task_ms), each also sent
    # at least once per faulted-traffic phase.
    chain: ChainShape | None = None
    task_crash_share: float = 0.0
    task_crash_after_commit_share: float = 0.0
    slow_task_share: float = 0.0
    slow_task_ms: tuple[int, int] = (2500, 4000)

    def share(self, kind: str) -> float:
        """The share of logical requests of a client- or task-triggered fault ``kind``."""
        return float(getattr(self, KIND_SHARES[kind]))


FAULT_KINDS = ("worker-kill", "db-outage", "connection-cut")
# Client-triggered faults of the traffic, by exchange kind.
CLIENT_FAULT_KINDS = ("crash", "fail", "slow", "cross-principal", "rolled back", "cookie")
# Faults the charge's ledger task makes to its own worker (chain profiles).
TASK_FAULT_KINDS = ("task crash", "task crash after commit", "slow task")
# Chain faults made from outside (tests/reliability/chain.py), as ChainShape.fault_weights
# names them; each destination's report names them its own way (a Celery worker kill, an RQ
# work horse kill: ChainDestination.fault_kinds).
CHAIN_FAULT_KINDS = (
    "relay-kill",
    "relay-kill between publish and mark",
    "consumer-kill",
    "consumer-child-kill",
    "broker-restart",
)
KIND_SHARES = {
    "crash": "crash_share",
    "fail": "fail_share",
    "slow": "slow_share",
    "cross-principal": "cross_principal_share",
    "rolled back": "rollback_share",
    "cookie": "cookie_share",
    "task crash": "task_crash_share",
    "task crash after commit": "task_crash_after_commit_share",
    "slow task": "slow_task_share",
}
# The attacks of issue 9, each made once per run (tests/reliability/attacks.py).
ATTACK_KINDS = (
    "rolled-back 2xx",
    "waiting-duplicate flood",
    "forged lock key",
    "oversized 4xx",
    "multipart to a JSON-only endpoint",
)
# The deployment shapes of issue 22, each made once per run (tests/reliability/shapes.py).
SHAPE_KINDS = (
    "repeatable read database",
    "two app servers, two SECRET_KEYs",
    "@idempotent above authentication",
)
# Where the shapes' servers serve the suite's misordered view (urls.py, views.py).
MISORDERED_PATH = "/reliability/charges-misordered/"

# What the chain profiles share: charges only (the endpoint that captures and posts), token
# principals, and no rolled-back work: its clean retry reuses the key with another amount,
# which the processor refuses under the same downstream key (docs/side-effects.md: send
# downstream only what a re-execution sends again).
CHAIN_TRAFFIC: dict[str, Any] = {
    "endpoints": {"/api/charges/": 1},
    "token_principals": 4,
    "session_principals": 0,
    "fault_weights": {"worker-kill": 4, "db-outage": 2, "connection-cut": 2},
    "rollback_share": 0.0,
    "task_crash_share": 0.03,
    "task_crash_after_commit_share": 0.03,
    "slow_task_share": 0.02,
}

PROFILES = {
    "short": Profile(
        name="short",
        # Faults back to back rather than on timers: every kind comes in the first
        # seconds (the third fault starts within 3.2 s, maintenance within 3 s), and the
        # outages are crash-like stops with a short pause.
        traffic_seconds=4.0,
        shapes=(ServerShape(workers=4),),
        clients=12,
        token_principals=4,
        session_principals=1,
        fault_every=(0.3, 0.6),
        fault_weights={"worker-kill": 5, "db-outage": 1, "connection-cut": 3},
        outage_modes=("immediate",),
        outage_seconds=(0.1, 0.4),
        hot_key_clients=40,
        hot_key_delay_ms=2300,
        hot_key_read_timeout=3.0,
        scaling_batches=(1, 4),
        maintenance_every=2.0,
        # A slow handler never outlives back-to-back faults: the recovery finishes it.
        stragglers_seconds=1.0,
        flood_delay_ms=2500,
        # One charge of 1 s executed at most three times, on a database of its own, while
        # the other two shapes run: about 3 s.
        shape_delay_ms=1000,
        shape_duplicates=2,
        # Clients give up on an attempt after 1.5 s, and slow handlers outlast that by
        # 0.2 to 0.5 s: the same timeouts and retries as 3 s would make, sooner.
        policy=RetryPolicy(read_timeout=1.5, max_delay=1.5),
        slow_extra_seconds=(0.2, 0.5),
    ),
    # Several app server processes whose connections share a few server connections
    # through PgBouncer in transaction pooling mode (a command, like "long").
    "pgbouncer": Profile(
        name="pgbouncer",
        traffic_seconds=120.0,
        shapes=(
            ServerShape(workers=4, pgbouncer=True),
            ServerShape(workers=3, threads=4, pgbouncer=True),
        ),
        clients=12,
        token_principals=6,
        session_principals=1,
        fault_every=(1.0, 3.0),
        fault_weights={"worker-kill": 5, "db-outage": 1, "connection-cut": 3},
        hot_key_clients=100,
        maintenance_every=10.0,
    ),
    # The side-effect chain end to end (a command, minutes long): charges captured at the
    # fake processor and posted to the ledger through the outbox, while gunicorn workers,
    # relays and Celery workers are killed and the broker and PostgreSQL restarted.
    "chain": Profile(
        name="chain",
        traffic_seconds=240.0,
        shapes=(ServerShape(workers=3),),
        chain=ChainShape(settle=True),
        **CHAIN_TRAFFIC,
        clients=8,
        fault_every=(2.0, 5.0),
        maintenance_every=20.0,
    ),
    # The same, every kind of fault back to back in a few seconds: in the test suite. Each
    # kind comes within about 5 s (a new kind first, each 0.3 to 0.7 s after the last
    # chain fault and 0.5 to 1 s after the last server fault; maintenance within 4.5 s);
    # the traffic goes on after them, so that an armed relay has rows to die on.
    "chain-short": Profile(
        name="chain-short",
        traffic_seconds=7.0,
        shapes=(ServerShape(workers=3),),
        chain=ChainShape(
            fault_every=(0.3, 0.7), broker_down_seconds=(0.2, 0.6), drain_timeout=90.0
        ),
        **CHAIN_TRAFFIC,
        clients=6,
        fault_every=(0.5, 1.0),
        outage_modes=("immediate", "fast"),
        outage_seconds=(0.1, 0.4),
        maintenance_every=3.0,
        stragglers_seconds=1.0,
        # As in the short profile: timeouts at 1.5 s, slow handlers 0.2 to 0.5 s longer.
        policy=RetryPolicy(read_timeout=1.5, max_delay=1.5),
        slow_extra_seconds=(0.2, 0.5),
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
