"""The load: client threads sending logical requests, some built to trip a fault."""

from __future__ import annotations

import collections
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.reliability.client import Amounts, Exchange, Principal, SDKClient
from tests.reliability.profiles import CLIENT_FAULT_KINDS, TASK_FAULT_KINDS, Profile

# The DRF views (where a session could authenticate; the @idempotent view checks tokens only).
DRF_ENDPOINTS = ("/api/charges/", "/api/refunds/")


class Ledger:
    """Every exchange of the run, from every phase and thread."""

    def __init__(self, run_tag: str) -> None:
        self.run_tag = run_tag
        self.amounts = Amounts()
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()

    def new(
        self,
        principal: Principal,
        path: str = "/api/charges/",
        *,
        key: str | None = None,
        kind: str = "plain",
        expect: str = "effect",
        **fields: Any,
    ) -> Exchange:
        amount = self.amounts.take()
        body = {
            "amount": amount,
            "currency": "inr",
            # Not a field of the charge: a marker the leak check looks for in the logs.
            "memo": f"canary-{self.run_tag}-{amount}",
            **fields,
        }
        return self.add(Exchange(principal, path, key or str(uuid.uuid4()), body, kind, expect))

    def add(self, exchange: Exchange) -> Exchange:
        with self._lock:
            self.exchanges.append(exchange)
        return exchange


class Traffic:
    """``profile.clients`` threads, each an SDK client sending one request after another."""

    def __init__(
        self,
        base_url: str,
        principals: Sequence[Principal],
        profile: Profile,
        ledger: Ledger,
        seed: int,
    ) -> None:
        self.base_url = base_url
        self.principals = list(principals)
        self.profile = profile
        self.ledger = ledger
        self.seed = seed
        # Recent keys, for reusing them across principals, and each principal's keys: a
        # principal must never be handed one of its own keys by mistake.
        self._recent: collections.deque[str] = collections.deque(maxlen=200)
        self._used: collections.defaultdict[str, set[str]] = collections.defaultdict(set)
        self._keys_lock = threading.Lock()
        # Each client- or task-triggered fault the profile sends is sent at least once, by
        # the first clients to ask after their first request (cross-principal reuse needs a
        # key already sent).
        self._owed = [k for k in (*CLIENT_FAULT_KINDS, *TASK_FAULT_KINDS) if profile.share(k)]

    def run(self, seconds: float) -> None:
        stop_at = time.monotonic() + seconds
        with ThreadPoolExecutor(self.profile.clients, thread_name_prefix="client") as pool:
            futures = [
                pool.submit(self._client, random.Random(f"{self.seed}-{n}"), stop_at)
                for n in range(self.profile.clients)
            ]
            for future in futures:
                future.result()

    def _client(self, rng: random.Random, stop_at: float) -> None:
        client = SDKClient(self.base_url, self.profile.policy, rng)
        # Requests still retrying this long after the end are left to the recovery sweep.
        give_up_at = stop_at + self.profile.stragglers_seconds
        try:
            while time.monotonic() < stop_at:
                exchange = self._next(rng)
                with self._keys_lock:
                    self._used[exchange.principal.username].add(exchange.key)
                if exchange.kind == "rolled back":
                    self._rolled_back(client, exchange, give_up_at)
                    continue
                client.send(exchange, give_up_at - time.monotonic())
                with self._keys_lock:
                    self._recent.append(exchange.key)
                if exchange.success and rng.random() < self.profile.reuse_share:
                    # Same key, another request: a client bug the contract answers with 422.
                    reuse = self.ledger.new(
                        exchange.principal, exchange.path, key=exchange.key, kind="reuse",
                        expect="refused",
                    )  # fmt: skip
                    client.send(reuse, give_up_at - time.monotonic())
        finally:
            client.close()

    def _rolled_back(self, client: SDKClient, exchange: Exchange, give_up_at: float) -> None:
        """Sent once (every retry of it would roll back again): it must never be answered
        2xx. Then the same key with a clean body must execute, as the key was left free."""
        client.attempt(exchange)
        clean = self.ledger.new(
            exchange.principal, exchange.path, key=exchange.key, kind="after rollback"
        )
        client.send(clean, give_up_at - time.monotonic())

    def _next(self, rng: random.Random) -> Exchange:
        principal = rng.choice(self.principals)
        paths = self.profile.endpoints
        if principal.auth == "session":
            paths = {p: w for p, w in paths.items() if p in DRF_ENDPOINTS}
        path = rng.choices(list(paths), weights=list(paths.values()))[0]
        tag = f"{self.ledger.run_tag}-{uuid.uuid4().hex[:12]}"
        makers: dict[str, tuple[float, Callable[[], Exchange]]] = {
            "crash": (self.profile.crash_share, lambda: self.ledger.new(
                principal, path, kind="crash", crash_once=tag)),
            "fail": (self.profile.fail_share, lambda: self.ledger.new(
                principal, path, kind="fail", fail_once=tag)),
            # Longer than the client's read timeout: the client gives up on an attempt
            # that the server finishes, then retries the same key.
            "slow": (self.profile.slow_share, lambda: self.ledger.new(
                principal, path, kind="slow",
                delay_ms=int((self.profile.policy.read_timeout
                              + rng.uniform(*self.profile.slow_extra_seconds)) * 1000))),
            "cross-principal": (self.profile.cross_principal_share,
                                lambda: self._cross_principal(principal, path)),
            # The fault switch needs the library's transaction: not the plain baseline.
            "rolled back": (self.profile.rollback_share, lambda: self.ledger.new(
                principal, path, kind="rolled back", expect="none", fail="rollback_only")),
            "cookie": (self.profile.cookie_share, lambda: self.ledger.new(
                principal, path, kind="cookie", set_cookie=tag)),
            # The charge's ledger task kills its worker process mid-task, or after its commit
            # and before its ack, or outlasts Redis' visibility timeout (chain profiles).
            "task crash": (self.profile.task_crash_share, lambda: self.ledger.new(
                principal, path, kind="task crash", ledger_crash_once=tag)),
            "task crash after commit": (
                self.profile.task_crash_after_commit_share, lambda: self.ledger.new(
                    principal, path, kind="task crash after commit",
                    ledger_crash_after_commit_once=tag)),
            "slow task": (self.profile.slow_task_share, lambda: self.ledger.new(
                principal, path, kind="slow task",
                ledger_delay_ms=rng.randint(*self.profile.slow_task_ms))),
        }  # fmt: skip
        with self._keys_lock:
            owed = self._owed.pop() if self._owed and self._recent else None
        if owed is not None:
            return makers[owed][1]()
        roll = rng.random()
        for share, make in makers.values():
            if roll < share:
                return make()
            roll -= share
        return self.ledger.new(principal, path)

    def _cross_principal(self, principal: Principal, path: str) -> Exchange:
        # Another principal's key: must execute for this principal as if new.
        with self._keys_lock:
            own = self._used[principal.username]
            key = next((k for k in reversed(self._recent) if k not in own), None)
            if key is not None:
                own.add(key)
        return self.ledger.new(principal, path, key=key, kind="cross-principal")
