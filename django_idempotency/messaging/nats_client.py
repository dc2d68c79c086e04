"""nats-py's client as the NATS destination and the NATS consumer both use it: the message-id
header, the connection settings and their defaults, the errors that mean NATS is out of reach,
and an asyncio event loop on a thread of its own with bounded waits on the work given to it.
Below both, so that neither imports the other."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors

MSG_ID = "Nats-Msg-Id"
DEFAULTS: dict[str, Any] = {
    "servers": ["nats://127.0.0.1:4222"],
    # The subject of a message: its name (task name or topic), under a prefix of your choice.
    "subject": "{name}",
    # The stream the subject must land in (JetStream refuses the publish otherwise), or None.
    "stream": None,
    # Seconds to wait for the stream's acknowledgements of a batch, and to connect.
    "ack_timeout": 5.0,
    # More keyword arguments for nats.connect() (credentials, TLS, name).
    "connect": {},
}


async def _reported_by_the_relay(error: Exception) -> None:
    """nats-py's error callback: the relay logs the failure of the publish itself."""


# The relay reconnects by itself, after a pause, on its next pass: a client reconnecting in
# the background would hold publishes in its buffer, past the relay's wait for their acks.
CONNECT: dict[str, Any] = {
    "allow_reconnect": False,
    "connect_timeout": 2,
    "error_cb": _reported_by_the_relay,
}
# Out of reach, or JetStream not answering yet (a server starting): no fault of the message.
UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,
    nats.errors.TimeoutError,
    nats.errors.UnexpectedEOF,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


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
