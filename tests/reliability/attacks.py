"""The attacks of issue 9, each made once per run, back to back, against the served app.

- rolled-back 2xx: a view writes, marks its transaction for rollback and answers 201; the
  client must get a 500 problem+json, nothing may commit or be stored, the key stays free.
- waiting-duplicate flood: duplicates with ``Prefer: wait=10`` pile onto one slow charge;
  unrelated requests must still be served at once, and the duplicates past the per-process
  waiter cap get 409 at once.
- forged lock key: another principal's key whose lock collided under the old unkeyed lock
  id (``tests/reliability/forgery.py``) must not make the victim wait.
- oversized 4xx: a 2 MB invalid field, echoed in DRF's 400, is answered but not stored.
- multipart to a JSON-only endpoint: 415, nothing read into the store, the key stays free.

Each exchange goes in the ledger, so the run's invariant covers them too. The flood runs on
its own server while the forged key's slow charge, which Alice no longer waits on, ends.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import requests

from tests.reliability.app import serve
from tests.reliability.client import Attempt, Exchange, Principal, SDKClient
from tests.reliability.forgery import forge_colliding_key, lock_input
from tests.reliability.postgres import Database
from tests.reliability.profiles import Profile
from tests.reliability.report import Check
from tests.reliability.traffic import Ledger

# The flood's server lets fewer duplicates wait than it has threads (its own settings).
FLOOD_SETTINGS = "tests.reliability.flood_settings"
OVERSIZED_BYTES = 2 * 1024 * 1024
# An unrelated request answered within this long was not queued behind waiting duplicates
# (the slow charge they wait on takes longer); it leaves room for a loaded 2-core machine.
PROMPT_SECONDS = 1.5


@dataclass(frozen=True)
class Forged:
    victim: str
    key: str
    forger: str
    forged: str
    seconds: float


class Phase:
    """A phase made once per run (the attacks, the deployment shapes): what it needs of the
    run, the checks it adds to the report, and how many requests of each kind it sent."""

    def __init__(
        self,
        profile: Profile,
        database: Database,
        ledger: Ledger,
        rng: random.Random,
        logs: list[str],
        say: Callable[[str], None],
    ) -> None:
        self.say = say
        self.profile = profile
        self.database = database
        self.ledger = ledger
        self.rng = rng
        self.logs = logs
        self.checks: list[Check] = []
        # Kind -> how many of its requests were sent.
        self.made: Counter[str] = Counter()

    def timed(self, name: str, step: Callable[..., Any], *args: Any) -> Any:
        started = time.monotonic()
        try:
            return step(*args)
        finally:
            self.say(f"  {name}: {time.monotonic() - started:.1f}s")

    def client(self, base_url: str, read_timeout: float | None = None) -> SDKClient:
        policy = self.profile.policy
        if read_timeout is not None:
            policy = dataclasses.replace(policy, read_timeout=read_timeout)
        return SDKClient(base_url, policy, random.Random(self.rng.random()))


class Attacks(Phase):
    def run(self, base_url: str, alice: Principal, bob: Principal) -> list[Check]:
        shape, cap = self.profile.flood_shape, self.profile.flood_max_waiters
        with (
            ExitStack() as stack,
            ThreadPoolExecutor(2) as background,
            ThreadPoolExecutor(1) as holding,
        ):
            # The flood's server starts, and the forged key is found, while the first
            # attacks run.
            flood_server = background.submit(stack.enter_context, serve(
                self.database, shape, self.logs, settings=FLOOD_SETTINGS,
                env={"RELIABILITY_MAX_WAITERS": str(cap)},
            ))  # fmt: skip
            forged = background.submit(self.forge, alice, bob)
            self.timed("rolled-back 2xx", self.rolled_back, base_url, alice)
            self.timed("oversized 4xx", self.oversized_4xx, base_url, alice)
            self.timed("multipart", self.multipart, base_url, alice)
            judge_forgery = self.timed(
                "forged lock key", self.forged_key, base_url, alice, bob, forged.result(), holding
            )
            # The flood runs on its own server while Bob's forged charge is still held on
            # this one (Alice has her answer by then); the forgery is judged once it ends.
            self.timed("flood", self.flood, flood_server.result().url, alice, bob)
            self.timed("forged lock key, the held charge's end", judge_forgery)
        return self.checks

    def stored(self, key: str) -> int:
        with self.database.connect() as conn:
            row = conn.execute(
                "SELECT count(*) FROM django_idempotency_record WHERE key = %s", [key]
            ).fetchone()
        return int(row[0]) if row else 0

    # -- the attacks ----------------------------------------------------------------------

    def rolled_back(self, base_url: str, alice: Principal) -> None:
        client = self.client(base_url)
        wrong = []
        paths = ("/api/charges/", "/api/refunds/", "/api/charges-django/")
        for path in paths:
            attack = self.ledger.new(
                alice, path, kind="rolled back", expect="none", fail="rollback_only"
            )
            answer = client.attempt(attack)
            self.made["rolled-back 2xx"] += 1
            stored = self.stored(attack.key)
            clean = client.send(self.ledger.new(alice, path, key=attack.key, kind="after rollback"))
            if not (answer.status == 500 and answer.problem and not stored):
                wrong.append(f"{path}: {answer.outcome} problem={answer.problem} stored={stored}")
            elif clean.success is None or clean.success.replayed:
                wrong.append(f"{path}: the same key then answered {_outcomes(clean)}")
        self.checks.append(Check(
            "rolled-back 2xx: 500 problem+json, nothing stored, the key free",
            not wrong,
            "; ".join(wrong) or f"{len(paths)} endpoints: 500 problem+json, no record, "
            "then the same key with a clean body executed (201, not a replay)",
        ))  # fmt: skip
        client.close()

    def oversized_4xx(self, base_url: str, alice: Principal) -> None:
        client = self.client(base_url, read_timeout=30)
        wrong = []
        for path in ("/api/charges/", "/api/charges-django/"):
            # DRF echoes an invalid choice in its 400: the answer is as big as the field.
            attack = self.ledger.new(
                alice, path, kind="oversized 4xx", expect="none", fail="x" * OVERSIZED_BYTES
            )
            first, retry = client.attempt(attack), client.attempt(attack)
            self.made["oversized 4xx"] += 1
            stored = self.stored(attack.key)
            if (first.status, retry.status, retry.replayed, stored) != (400, 400, False, 0):
                wrong.append(
                    f"{path}: {first.outcome} ({len(first.body)} bytes), retry "
                    f"{retry.outcome}{' replayed' if retry.replayed else ''}, stored {stored}"
                )
        self.checks.append(Check(
            "oversized 4xx: answered 400, not stored",
            not wrong,
            "; ".join(wrong) or f"a {OVERSIZED_BYTES >> 20} MB invalid field on the DRF and "
            "@idempotent views: 400, no record, and the retry ran again",
        ))  # fmt: skip
        client.close()

    def multipart(self, base_url: str, alice: Principal) -> None:
        client = self.client(base_url, read_timeout=30)
        wrong = []
        upload = {"receipt": ("receipt.bin", random.randbytes(1 << 20), "application/pdf")}
        for path in ("/api/charges/", "/api/refunds/"):
            attack = self.ledger.new(alice, path, kind="multipart", expect="none")
            answer = client.attempt(attack, files=upload)
            self.made["multipart to a JSON-only endpoint"] += 1
            stored = self.stored(attack.key)
            after = self.ledger.new(alice, path, key=attack.key, kind="after multipart")
            clean = client.send(after)
            if answer.status != 415 or stored:
                wrong.append(f"{path}: {answer.outcome}, stored {stored}")
            elif clean.success is None or clean.success.replayed:
                wrong.append(f"{path}: the same key then answered {_outcomes(clean)}")
        self.checks.append(Check(
            "multipart to a JSON-only endpoint: 415, nothing stored, the key free",
            not wrong,
            "; ".join(wrong) or "a 1 MB multipart upload to the DRF JSON endpoints: 415, no "
            "record, then the same key with JSON executed",
        ))  # fmt: skip
        client.close()

    def forge(self, alice: Principal, bob: Principal) -> Forged:
        """Alice's next key, and Bob's key forged to collide with it under the old lock id
        (CPU-bound: it runs while the first attacks wait on the server)."""
        with self.database.connect() as conn:
            ids = dict(conn.execute("SELECT username, id FROM auth_user").fetchall())
        victim, forger = f"user:{ids[alice.username]}", f"user:{ids[bob.username]}"
        alice_key = str(uuid.uuid4())
        started = time.monotonic()
        bob_key = forge_colliding_key(victim, alice_key, forger, random.Random(self.rng.random()))
        return Forged(victim, alice_key, forger, bob_key, time.monotonic() - started)

    def forged_key(
        self,
        base_url: str,
        alice: Principal,
        bob: Principal,
        forged: Forged,
        holding: ThreadPoolExecutor,
    ) -> Callable[[], None]:
        """Bob holds a slow charge under a key forged to share the old lock id of Alice's
        next key; Alice's request must not wait for it. Returns what judges the attack once
        Bob's charge has ended (his request runs on ``holding``)."""
        victim, alice_key, forger, bob_key = forged.victim, forged.key, forged.forger, forged.forged
        with self.database.connect() as conn:
            row = conn.execute(
                "SELECT hashtextextended(%s, 0) = hashtextextended(%s, 0)",
                [lock_input(victim, alice_key).decode(), lock_input(forger, bob_key).decode()],
            ).fetchone()
        collides = bool(row and row[0])
        delay = self.profile.flood_delay_ms
        slow = self.ledger.new(bob, key=bob_key, kind="forged lock key", delay_ms=delay)
        fresh = self.ledger.new(alice, key=alice_key, kind="forged lock key victim")
        before = executions(base_url)
        holder = holding.submit(self.client(base_url, read_timeout=30).attempt, slow)
        wait_for_handler(base_url, before)
        started = time.monotonic()
        answer = self.client(base_url).attempt(fresh)
        waited = time.monotonic() - started
        self.made["forged lock key"] += 1

        def judge() -> None:
            held = holder.result()
            self.checks.append(Check(
                "forged lock key: collides under the old unkeyed lock id",
                collides,
                f"hashtextextended(principal || chr(1) || key, 0) equal for Alice's key and "
                f"Bob's {len(bob_key)}-character key (forged in {forged.seconds:.1f}s): "
                f"{collides}",
            ))  # fmt: skip
            self.checks.append(Check(
                "forged lock key: another principal is not blocked",
                answer.ok and not answer.replayed and waited < PROMPT_SECONDS and held.ok,
                f"Alice answered {answer.outcome} in {waited:.2f}s while Bob's forged key "
                f"held a {delay} ms charge (answered {held.outcome})",
            ))  # fmt: skip

        return judge

    def flood(self, url: str, alice: Principal, bob: Principal) -> None:
        """One slow charge, ``flood_duplicates`` duplicates willing to wait 10 s, and,
        while they wait, an unrelated charge and an unrelated GET, on the flood's server
        (``flood_shape``, at most ``flood_max_waiters`` waiting per process)."""
        shape, cap = self.profile.flood_shape, self.profile.flood_max_waiters
        with ExitStack() as stack:
            slow = self.ledger.new(alice, kind="flood", delay_ms=self.profile.flood_delay_ms)
            duplicates = [
                self.ledger.add(Exchange(alice, slow.path, slow.key, slow.body, "flood duplicate"))
                for _ in range(self.profile.flood_duplicates)
            ]
            unrelated = self.ledger.new(bob, kind="flood bystander")
            pool = stack.enter_context(ThreadPoolExecutor(len(duplicates) + 1))
            before = executions(url)
            holder = pool.submit(self.client(url, read_timeout=30).attempt, slow)
            wait_for_handler(url, before)
            timed: list[tuple[Attempt, float]] = []
            lock = threading.Lock()

            def duplicate(exchange: Exchange) -> None:
                started = time.monotonic()
                attempt = self.client(url, read_timeout=30).attempt(
                    exchange, headers={"Prefer": "wait=10"}
                )
                with lock:
                    timed.append((attempt, time.monotonic() - started))

            waiting = [pool.submit(duplicate, e) for e in duplicates]
            # Let the duplicates reach the server and start waiting.
            time.sleep(0.3)
            started = time.monotonic()
            bystander = self.client(url).attempt(unrelated)
            post_seconds = time.monotonic() - started
            started = time.monotonic()
            listing = requests.get(url + "/api/charges/count/", timeout=30)
            get_seconds = time.monotonic() - started
            holder.result()
            for future in waiting:
                future.result()
            # The 409s are retried until answered: they must end as replays of the one run.
            for exchange in duplicates:
                if exchange.success is None:
                    self.client(url).send(exchange)
        self.made["waiting-duplicate flood"] += len(duplicates)
        refused = [(a, s) for a, s in timed if a.status == 409]
        # Answered by the replay after waiting for the slow charge to finish.
        waited = [(a, s) for a, s in timed if a.ok and s > 0.5]
        self.checks.append(Check(
            "waiting-duplicate flood: unrelated requests are served at once",
            bystander.ok and listing.status_code == 200
            and max(post_seconds, get_seconds) < PROMPT_SECONDS,
            f"{len(duplicates)} duplicates (Prefer: wait=10) on a "
            f"{self.profile.flood_delay_ms} ms charge, {shape.describe()}: another "
            f"principal's POST {bystander.outcome} in {post_seconds:.2f}s, a GET "
            f"{listing.status_code} in {get_seconds:.2f}s",
        ))  # fmt: skip
        bodies = {e.success.body for e in [slow, *duplicates] if e.success is not None}
        self.checks.append(Check(
            "waiting-duplicate flood: past the waiter cap, 409 at once; one execution",
            bool(refused)
            and all(a.problem == "in-progress" and a.retry_after for a, _ in refused)
            and max(s for _, s in refused) < PROMPT_SECONDS
            and len(waited) <= cap * shape.workers
            and len(bodies) == 1 and all(e.success for e in [slow, *duplicates]),
            f"IDEMPOTENCY_MAX_WAITERS={cap}: {len(refused)} got 409 (slowest in "
            f"{max((s for _, s in refused), default=0):.2f}s), {len(waited)} waited and got "
            f"the replay, {_counts(Counter(a.outcome for a, _ in timed))}; after retries "
            f"{len(bodies)} distinct answer",
        ))  # fmt: skip


def wait_for_handler(
    base_url: str, before: int, holder: Future[Any] | None = None, timeout: float = 10.0
) -> None:
    """Until the slow handler runs (it counts itself first): its claim is held. Or until
    ``holder``, the request sending it, has its answer: a refusal runs no handler."""
    deadline = time.monotonic() + timeout
    while executions(base_url) == before:
        if holder is not None and holder.done():
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the slow charge never started")
        time.sleep(0.05)


def executions(base_url: str) -> int:
    """How many times the charge handler ran on ``base_url``'s database."""
    response = requests.get(base_url + "/api/charges/count/", timeout=30)
    response.raise_for_status()
    return int(json.loads(response.content)["executions"])


def _outcomes(exchange: Exchange) -> str:
    return " ".join(a.outcome for a in exchange.attempts) or "never sent"


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counter.items()))
