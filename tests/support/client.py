"""Sending scripted JSON requests with an Idempotency-Key through Django's test client, and
reading what came back (any client's response)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.test import Client


def send(
    client: Client,
    method: str,
    path: str,
    body: Any = None,
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> Any:
    """``method`` ``path`` with ``body`` as JSON (a str or bytes is sent as it is)."""
    all_headers = dict(headers or {})
    if key is not None:
        all_headers["Idempotency-Key"] = key
    if body is not None and not isinstance(body, str | bytes):
        body = json.dumps(body)
    extra.setdefault("content_type", "application/json")
    return client.generic(method, path, body or b"", headers=all_headers, **extra)


def replayed(response: Any) -> bool:
    """Whether a response (Django's, DRF's or ``requests``') is a replay of a stored one."""
    return response.headers.get("Idempotent-Replayed") == "true"


def problem(response: Any) -> dict[str, Any]:
    """The problem+json body of an error the app produced."""
    assert response["Content-Type"] == "application/problem+json", response.content
    assert response["Cache-Control"] == "no-store"
    body: dict[str, Any] = json.loads(response.content)
    return body


R = TypeVar("R")


def honouring_retry_after(send: Callable[[], R], timeout: float = 30) -> R:
    """``send()`` again while it answers ``409 in-progress``, after its ``Retry-After``, as a
    client does (no waiting is the default): a worker killed mid-request holds its key
    until PostgreSQL notices the lost connection."""
    deadline = time.monotonic() + timeout
    while True:
        response: Any = send()
        if response.status_code != 409 or time.monotonic() > deadline:
            return response  # type: ignore[no-any-return]
        time.sleep(int(response.headers["Retry-After"]))
