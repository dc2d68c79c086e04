"""Assertions for a project's own test suite: one line says an endpoint is exactly-once.

Plain functions that raise ``AssertionError`` (pytest and unittest alike), for Django's test
``Client`` and DRF's ``APIClient``; see docs/testing.md.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

from django.db import DEFAULT_DB_ALIAS, connections
from django.http.response import HttpResponseBase
from django.test import Client

from django_idempotency.conf import conf
from django_idempotency.storage import records

__all__ = [
    "Replayed",
    "SimulatedCrash",
    "assert_crash_after_write_leaves_key_free",
    "assert_executes_once",
    "assert_replays",
    "assert_reused_key_refused",
    "new_key",
]

REPLAYED_HEADER = "Idempotent-Replayed"  # the contract's name (section 5)
Effects = Callable[[], int]


class SimulatedCrash(Exception):
    """Raised where the response would be stored: the worker "dies" after the view's write."""


@dataclass(frozen=True)
class Replayed:
    first: HttpResponseBase
    retry: HttpResponseBase


def new_key() -> str:
    """A fresh key: a key reused across tests would make one test replay another's answer."""
    return str(uuid.uuid4())


def send(
    client: Client,
    path: str,
    data: Any = None,
    *,
    key: str | None,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> HttpResponseBase:
    """One request with ``key`` in the key header; ``data`` goes as JSON unless ``extra`` says
    how to encode it (``format=`` for ``APIClient``, ``content_type=``)."""
    headers = dict(headers or {})
    if key is not None:
        headers[conf.HEADER] = key
    if data is not None and "format" not in extra and "content_type" not in extra:
        data, extra["content_type"] = json.dumps(data), "application/json"
    response: HttpResponseBase = client.generic(
        method.upper(),
        path,
        data=data if data is not None else "",
        headers=headers,
        **extra,
    )
    return response


def assert_replays(
    client: Client, path: str, data: Any = None, *, key: str | None = None, **request: Any
) -> Replayed:
    """Send a request twice with one key: the retry is a replay, byte for byte."""
    key = key or new_key()
    first = send(client, path, data, key=key, **request)
    retry = send(client, path, data, key=key, **request)
    _check(first.status_code < 500, f"the first request failed: {_describe(first)}")
    _check(
        first.get(REPLAYED_HEADER) is None,
        f"the first request was a replay: is the key {key} used elsewhere?",
    )
    _check(
        retry.get(REPLAYED_HEADER) == "true",
        f"the retry was not replayed ({_describe(retry)}): is the view protected?",
    )
    _check(
        (retry.status_code, _body(retry)) == (first.status_code, _body(first)),
        f"the replay differs from the first response: {_describe(first)} then {_describe(retry)}",
    )
    _check(
        retry.get("Content-Type") == first.get("Content-Type"),
        "the replay's Content-Type differs from the first response's",
    )
    return Replayed(first, retry)


def assert_reused_key_refused(
    client: Client, path: str, data: Any, other: Any, **request: Any
) -> HttpResponseBase:
    """A key reused for another request (``other`` in place of ``data``) gets 422 and runs
    nothing."""
    key = new_key()
    send(client, path, data, key=key, **request)
    reused = send(client, path, other, key=key, **request)
    _check(reused.status_code == 422, f"a reused key got {_describe(reused)}, not 422 key-reused")
    _check(
        reused.get("Content-Type", "").startswith(("application/problem+json", "application/json")),
        f"the 422 is not an error document: {reused.get('Content-Type')}",
    )
    return reused


def assert_executes_once(
    clients: Callable[[], Client],
    path: str,
    data: Any = None,
    *,
    effects: Effects,
    duplicates: int = 8,
    **request: Any,
) -> list[HttpResponseBase]:
    """``duplicates`` requests with one key, sent at once from as many threads, each over its own
    database connection: ``effects()`` (say, ``Charge.objects.count``) grows by exactly one.

    The others are replays of the first or ``409`` (without waiting, the default). Needs a
    transactional test (``django_db(transaction=True)``, ``TransactionTestCase``): inside one
    test transaction, requests cannot overlap."""
    if connections[DEFAULT_DB_ALIAS].in_atomic_block:
        raise AssertionError(
            "assert_executes_once needs a transactional test (pytest-django's "
            "django_db(transaction=True), or TransactionTestCase): inside the test's "
            "transaction the threads' connections do not see its rows, and requests on one "
            "connection cannot run at once."
        )
    key, before = new_key(), effects()
    barrier = threading.Barrier(duplicates)

    def one(_: int) -> HttpResponseBase:
        client = clients()
        try:
            barrier.wait(timeout=60)
            return send(client, path, data, key=key, **request)
        finally:
            connections.close_all()  # this thread's connections

    with ThreadPoolExecutor(duplicates) as pool:
        responses = list(pool.map(one, range(duplicates)))
    statuses = sorted(response.status_code for response in responses)
    ran = effects() - before
    _check(ran == 1, f"{duplicates} duplicates had {ran} effects, not 1 (statuses {statuses})")
    firsts = [r for r in responses if r.status_code < 300 and r.get(REPLAYED_HEADER) is None]
    _check(len(firsts) == 1, f"{len(firsts)} of the duplicates executed (statuses {statuses})")
    (first,) = firsts
    for response in responses:
        if response is first or response.status_code == 409:
            continue
        _check(
            response.get(REPLAYED_HEADER) == "true" and _body(response) == _body(first),
            f"a duplicate was neither a replay of the first nor 409: {_describe(response)}",
        )
    return responses


def assert_crash_after_write_leaves_key_free(
    client: Client, path: str, data: Any = None, *, effects: Effects, **request: Any
) -> HttpResponseBase:
    """The worker dies after the view's write, before its response is stored: nothing the view
    wrote stays (``effects()`` unchanged), and the retry with the same key executes once.

    A view that sends an email or calls an API before that point has done so: that is what
    the outbox and derived keys are for (docs/side-effects.md)."""
    key, before = new_key(), effects()
    with crashing_after_write():
        try:
            crashed = send(client, path, data, key=key, **request)
        except SimulatedCrash:
            pass  # Django's test client re-raises the view's exception (raise_request_exception)
        else:
            _check(
                crashed.status_code >= 500,
                f"the crashed request was answered {_describe(crashed)}",
            )
    _check(
        effects() == before,
        f"the crashed request left {effects() - before} effect(s): does the view write "
        "outside the request's transaction (another database, autocommit, a thread)?",
    )
    retry = send(client, path, data, key=key, **request)
    _check(
        retry.status_code < 300 and retry.get(REPLAYED_HEADER) is None,
        f"the retry after the crash did not execute: {_describe(retry)}",
    )
    _check(effects() == before + 1, f"the retry had {effects() - before} effects, not 1")
    return retry


@contextmanager
def crashing_after_write() -> Iterator[None]:
    """Within it, every protected request fails where its response would be stored."""

    def crash(*args: Any, **kwargs: Any) -> None:
        raise SimulatedCrash("simulated crash after the view's write")

    with mock.patch.object(records, "store", side_effect=crash):
        yield


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _body(response: HttpResponseBase) -> bytes:
    return b"".join(response) if response.streaming else response.content  # type: ignore[attr-defined]


def _describe(response: HttpResponseBase) -> str:
    body = _body(response)[:200].decode("utf-8", "replace")
    return f"{response.status_code} {body!r}"
