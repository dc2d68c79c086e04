"""How a duplicate waits for the request that holds its key: the pauses between its claims,
and the per-process cap on requests that wait on a thread of their own."""

from __future__ import annotations

import os
import re
import threading
import time
from datetime import timedelta

from django_idempotency.conf import conf

# A waiting request tries the claim again after a pause that doubles from the first to the
# longest: a short holder is seen soon, a long one costs a few cheap claims a second.
FIRST_PAUSE = 0.05
LONGEST_PAUSE = 0.5
GUNICORN_THREADS = re.compile(r"--threads[= ]+(\d+)")


class _Waiters:
    """How many requests of this process may wait for a holder on a thread of their own
    right now (sync views, and async views under WSGI): ``count``, capped so that waiting
    duplicates always leave a thread free for other requests. ``waiting``: the requests
    waiting now, async ones included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.waiting = 0

    def enter(self) -> bool:
        limit = waiter_limit()
        with self._lock:
            if self.count >= limit:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.count -= 1

    def slept(self, started: bool) -> bool:
        """Count a request that goes to sleep for the first time; True from then on."""
        if not started:
            with self._lock:
                self.waiting += 1
        return True

    def woke(self, started: bool) -> None:
        if started:
            with self._lock:
                self.waiting -= 1


def waiter_limit() -> int:
    """How many requests of this process may wait on a thread of their own at once."""
    if threading.current_thread() is threading.main_thread():
        # A process that serves requests on its main thread serves one at a time (gunicorn's
        # sync worker, uWSGI without threads): a waiting request would hold all of it.
        return 0
    limit = conf.MAX_WAITERS
    threads, _ = server_threads()
    if threads is not None:
        limit = min(limit, threads - 1)
    return max(limit, 0)


def server_threads() -> tuple[int | None, str]:
    """The request threads of one server process, and where that was learnt:
    IDEMPOTENCY_SERVER_THREADS, else gunicorn's ``--threads`` in GUNICORN_CMD_ARGS; None
    when neither says."""
    threads = conf.SERVER_THREADS
    if threads is not None:
        return threads, "IDEMPOTENCY_SERVER_THREADS"
    args = os.environ.get("GUNICORN_CMD_ARGS")
    if args is None:
        return None, ""
    found = GUNICORN_THREADS.search(args)
    # gunicorn's default is one thread (its sync worker).
    return (int(found.group(1)) if found else 1), "GUNICORN_CMD_ARGS"


waiters = _Waiters()


class Patience:
    """One duplicate's wait, from the moment ``open()`` starts: its deadline, the pause
    before its next claim, and the waiter slot it holds, if any."""

    __slots__ = ("_pause", "_slot", "deadline", "started")

    def __init__(self, wait: timedelta) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + wait.total_seconds()
        self._pause = FIRST_PAUSE
        self._slot = False

    def next_pause(self) -> float:
        pause = min(self._pause, max(self.deadline - time.monotonic(), 0.0))
        self._pause = min(self._pause * 2, LONGEST_PAUSE)
        return pause

    def may_wait(self, capped: bool | None) -> bool:
        """Whether a busy claim may be tried again: time is left and, if the request waits
        on a thread of its own (``capped``), it holds a waiter slot. ``capped`` None: never."""
        if capped is None or time.monotonic() >= self.deadline:
            return False
        if capped and not self._slot:
            # Taken at the first busy claim, on the request's thread, and kept until open()
            # ends: a request that never waits never takes one.
            self._slot = waiters.enter()
        return self._slot or not capped

    def leave(self) -> None:
        if self._slot:
            self._slot = False
            waiters.leave()
