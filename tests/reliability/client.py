"""Clients that retry like payment SDKs, and the record of every exchange they make."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import requests

from tests.reliability.profiles import RetryPolicy

# Stripe's SDKs and most others retry these (409 is Stripe's idempotency_key_in_use).
RETRYABLE_STATUSES = frozenset({409, 429, 500, 502, 503, 504})
TIMEOUT, CONNECTION_ERROR = "timeout", "connection-error"
# The problem type of a deployment that cannot keep the promise: nothing ran, and every
# retry gets the same answer until the deployment is fixed.
MISCONFIGURED = "misconfigured"
# What an exchange of a deployment shape (shapes.py) must end as: one effect of its own, or
# a refusal with nothing executed (``refusal``).
EFFECT_OR_REFUSAL = "effect or refusal"


@dataclass(frozen=True)
class Principal:
    """Who sends a request, and the credentials that must never show up in logs."""

    username: str
    auth: str  # "token", "session" or "anonymous"
    headers: Mapping[str, str]
    secrets: tuple[str, ...] = ()


@dataclass
class Attempt:
    """One HTTP request of an exchange."""

    started: float
    latency: float
    status: int | None
    outcome: str  # the status code as text, or TIMEOUT / CONNECTION_ERROR
    replayed: bool = False
    body: bytes = b""
    problem: str | None = None  # the problem type's name, for problem+json answers
    retry_after: float | None = None
    sets_cookie: bool = False

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        if self.problem == MISCONFIGURED:
            return False
        return self.status is None or self.status in RETRYABLE_STATUSES

    @property
    def refusal(self) -> bool:
        """Refused with nothing executed: the library's ``misconfigured``, or the view's
        own authentication."""
        return (self.status == 500 and self.problem == MISCONFIGURED) or self.status in (401, 403)


@dataclass
class Exchange:
    """A logical request: one key, one body, sent as many times as it takes.

    Every exchange of a run carries its own ``amount``, so the committed rows of each one
    can be counted in the database.
    """

    principal: Principal
    path: str
    key: str
    body: dict[str, Any]
    kind: str = "plain"  # plain, crash, fail, slow, cross-principal, reuse, hot, ...
    # "effect": must end 2xx with exactly one row; "refused": must end 422 with no row;
    # "none": must never end 2xx (the store was down, or the principal may not call);
    # EFFECT_OR_REFUSAL: either "effect", or a refusal with no row (``Attempt.refusal``).
    expect: str = "effect"
    attempts: list[Attempt] = field(default_factory=list)
    # The database the served app wrote to, when it is not the run's own (its name).
    database: str | None = None

    @property
    def amount(self) -> int:
        return int(self.body["amount"])

    @property
    def success(self) -> Attempt | None:
        return next((a for a in self.attempts if a.ok), None)

    @property
    def final(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def faulted(self) -> bool:
        return any(not a.ok for a in self.attempts)

    @property
    def seconds(self) -> float:
        """From the first send to the first final answer (2xx, or a 4xx not retried), or
        to the last attempt."""
        end = next((a for a in self.attempts if not a.retryable), self.final)
        return end.started + end.latency - self.attempts[0].started if end else 0.0

    def describe(self) -> str:
        return f"{self.kind} {self.path} amount {self.amount} ({self.principal.auth}): " + " ".join(
            a.outcome + ("r" if a.replayed else "") for a in self.attempts
        )


class Amounts:
    """Unique amounts for a whole run, shared by all threads."""

    def __init__(self, start: int = 1000) -> None:
        self._next = start
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            self._next += 1
            return self._next


class SDKClient:
    """One client thread's connection pool and retry loop."""

    def __init__(self, base_url: str, policy: RetryPolicy, rng: random.Random) -> None:
        self.base_url = base_url
        self.policy = policy
        self.rng = rng
        self.session = requests.Session()

    def close(self) -> None:
        self.session.close()

    def attempt(
        self,
        exchange: Exchange,
        headers: Mapping[str, str] | None = None,
        files: Mapping[str, tuple[str, bytes, str]] | None = None,
    ) -> Attempt:
        """Send the exchange once; ``headers`` add to or replace the usual ones. With
        ``files``, the body goes as multipart/form-data (its fields, then the files)."""
        all_headers = {
            **exchange.principal.headers,
            "Idempotency-Key": exchange.key,
            **(headers or {}),
        }
        if files is None:
            all_headers.setdefault("Content-Type", "application/json")
            payload: dict[str, Any] = {"data": json.dumps(exchange.body)}
        else:
            payload = {"data": {k: str(v) for k, v in exchange.body.items()}, "files": files}
        started = time.monotonic()
        try:
            response = self.session.post(
                self.base_url + exchange.path,
                headers=all_headers,
                timeout=(self.policy.connect_timeout, self.policy.read_timeout),
                **payload,
            )
        except requests.Timeout:
            attempt = Attempt(started, time.monotonic() - started, None, TIMEOUT)
        except requests.RequestException:
            attempt = Attempt(started, time.monotonic() - started, None, CONNECTION_ERROR)
        else:
            attempt = Attempt(
                started, time.monotonic() - started, response.status_code,
                str(response.status_code),
                replayed=response.headers.get("Idempotent-Replayed") == "true",
                body=response.content, problem=_problem_name(response),
                retry_after=_retry_after(response),
                sets_cookie="Set-Cookie" in response.headers,
            )  # fmt: skip
            # An SDK keeps no cookies: each attempt carries only the principal's headers.
            self.session.cookies.clear()
        exchange.attempts.append(attempt)
        return attempt

    def send(self, exchange: Exchange, give_up_after: float | None = None) -> Exchange:
        """Send until a final answer (2xx or a non-retryable 4xx) or until giving up."""
        limit = self.policy.give_up_after
        if give_up_after is not None:
            limit = min(limit, give_up_after)
        deadline = time.monotonic() + limit
        for retries in itertools.count():
            attempt = self.attempt(exchange)
            if not attempt.retryable:
                break
            # Full jitter (AWS's "exponential backoff and jitter"); a server's Retry-After
            # is a floor, as Stripe's SDKs treat it, within the same cap.
            ceiling = self.policy.base_delay * 2 ** min(retries, 16)
            delay = self.rng.uniform(0, min(self.policy.max_delay, ceiling))
            if attempt.retry_after is not None:
                delay = max(delay, min(attempt.retry_after, self.policy.max_delay))
            if time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
        return exchange


def _problem_name(response: requests.Response) -> str | None:
    if response.headers.get("Content-Type") != "application/problem+json":
        return None
    try:
        problem_type = str(response.json().get("type", ""))
    except ValueError:
        return None
    return problem_type.rsplit(":", 1)[-1].rsplit("/", 1)[-1]


def _retry_after(response: requests.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None
