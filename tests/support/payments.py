"""The payments API over real HTTP, as the end-to-end scenarios drive it: posting a charge,
reading the handler's execution counter, sending requests at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import requests

from django_idempotency.models import IdempotencyRecord
from tests.support.chain_processes import wait_for

T = TypeVar("T")

CHARGE = {"amount": 2499, "currency": "inr"}


class Counts(NamedTuple):
    executions: int
    rows: int

    def __sub__(self, other: tuple[int, int]) -> Counts:
        return Counts(self.executions - other[0], self.rows - other[1])


def counts(base_url: str, path: str = "/api/charges/count/") -> Counts:
    # A busy machine can take seconds to answer; the count itself is what is checked.
    response = requests.get(base_url + path, timeout=60)
    response.raise_for_status()
    return Counts(**response.json())


def start_first(
    pool: ThreadPoolExecutor,
    base_url: str,
    user: Any,
    key: str,
    body: dict[str, Any],
    before: Counts,
) -> Future[requests.Response]:
    """Send the first attempt and return once its handler runs (it holds the claim): a fixed
    pause let a duplicate overtake it on a busy machine."""
    first = pool.submit(post, base_url, user, key, body)
    wait_for(lambda: first.done() or counts(base_url).executions > before.executions)
    return first


def post(
    base_url: str,
    user: Any,
    key: str | None,
    body: dict[str, Any],
    path: str = "/api/charges/",
    **headers: str,
) -> requests.Response:
    if key is not None:
        headers["Idempotency-Key"] = key
    return requests.post(
        base_url + path, json=body, headers={**user.headers, **headers}, timeout=30
    )


def records(key: str) -> int:
    return IdempotencyRecord.objects.filter(key=key).count()


def send_at_once(calls: list[Callable[[], T]]) -> list[T]:
    """Run each call in its own thread, all released together by a barrier."""
    barrier = threading.Barrier(len(calls))

    def send(call: Callable[[], T]) -> T:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(send, calls))
