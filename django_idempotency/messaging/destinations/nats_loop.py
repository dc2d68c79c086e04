"""nats-py's asyncio client from synchronous code: an event loop on a thread of its own,
and bounded waits on the work given to it (the NATS destination and the NATS consumer)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def result(future: concurrent.futures.Future[T], timeout: float) -> T:
    """The outcome of work on the loop; TimeoutError after ``timeout`` seconds, the work
    cancelled: the caller never waits unbounded on NATS."""
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        if future.done():
            # The work's own timeout (nats.errors.TimeoutError is a TimeoutError too, as
            # concurrent.futures' is since Python 3.11): its caller's to handle, as it is.
            raise
        future.cancel()
        raise TimeoutError(f"NATS did not answer within {timeout:g} s") from None


class ClientLoop:
    """An event loop running on a daemon thread, started on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the loop; its future, to wait on with ``result()``."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
            self._thread.start()
            self._loop = loop
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coroutine`` on the loop and wait for it, at most ``timeout`` seconds."""
        return result(self.submit(coroutine), timeout)

    def stop(self) -> None:
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            if not thread.is_alive():
                loop.close()
