"""An exactly-once NATS JetStream consumer: a durable pull consumer whose handler runs in the
exactly-once core (``exactly_once.consume``), keyed by the message's ``Nats-Msg-Id`` and scoped
by the durable's name; the handler's writes and the record commit together, then the message
is acknowledged; a failure gives it back (a negative acknowledgement) to be delivered again."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import nats
import nats.errors
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections
from nats.js.api import AckPolicy, ConsumerConfig

from django_idempotency.engine.errors import KeyReused
from django_idempotency.messaging.consumers.exactly_once import Delivery, consume
from django_idempotency.messaging.nats_client import (
    CONNECT,
    DEFAULTS,
    MSG_ID,
    UNREACHABLE,
    ClientLoop,
)
from django_idempotency.messaging.tracing import NATS, consume_span_from_headers

logger = logging.getLogger("django_idempotency.consumers")

# After a failure to reach NATS, the consumer waits this long before connecting again.
RECONNECT_PAUSE = 1.0


@dataclass(frozen=True)
class StreamMessage:
    """One delivery of a stream message, as the handler sees it."""

    subject: str
    data: bytes
    headers: Mapping[str, str]
    # Its Nats-Msg-Id (the outbox's message id); without one, "<stream>:<sequence>".
    id: str
    stream: str
    sequence: int
    # 1 on the first delivery, more on redeliveries.
    delivered: int

    def json(self) -> Any:
        """The body as JSON: an outbox event's payload; a task's {"args", "kwargs"}."""
        return json.loads(self.data)


Handler = Callable[[StreamMessage], Any]


class _GiveBack(Exception):
    """The core asks for the message to be delivered again (a negative acknowledgement)."""


def _give_back(exc: Exception) -> NoReturn:
    raise _GiveBack(str(exc)) from exc


class NatsConsumer:
    """Runs ``handler`` once per message id of a JetStream durable pull consumer.

    The durable (``durable`` on ``stream``, filtered to ``subject`` if given) is created with
    explicit acks if it does not exist. Each message is handled inside one transaction with
    the record of ``(consumer, message id)`` (``consumer`` defaults to the durable's name);
    the message is acknowledged only after that commit. A redelivery (JetStream's after
    ``ack_wait``, a consumer killed before its ack, the same id published again after the
    stream's duplicate window) finds the record and is acknowledged without running the
    handler. A handler that raises leaves nothing, and the message is delivered again after
    ``nak_delay`` seconds (at most ``max_deliver`` times in all, if set).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        stream: str,
        durable: str,
        subject: str = "",
        consumer: str | None = None,
        servers: Sequence[str] | str = DEFAULTS["servers"],
        batch: int = 10,
        ack_wait: float = 30.0,
        max_deliver: int = -1,
        nak_delay: float = 1.0,
        connect: Mapping[str, Any] | None = None,
    ) -> None:
        if not stream or not durable:
            raise ImproperlyConfigured("A NATS consumer needs a stream and a durable name.")
        if batch < 1 or ack_wait <= 0:
            raise ImproperlyConfigured(
                f"A NATS consumer needs batch >= 1 and ack_wait > 0 (got {batch}, {ack_wait})."
            )
        self.handler = handler
        self.stream = stream
        self.durable = durable
        self.subject = subject
        self.consumer = consumer or durable
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.batch = batch
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self.nak_delay = nak_delay
        self.connect_options = {**CONNECT, **(connect or {})}
        self.stopping = threading.Event()
        self._loop = ClientLoop(f"nats-consumer-{durable}")
        self._client: Any = None
        self._subscription: Any = None

    # The connection and the durable --------------------------------------------------

    def open(self) -> None:
        if self._subscription is not None:
            return
        timeout = float(self.connect_options.get("connect_timeout", 2)) * len(self.servers) + 5
        self._client, self._subscription = self._loop.run(self._open(), timeout)

    async def _open(self) -> tuple[Any, Any]:
        client = await nats.connect(servers=self.servers, **self.connect_options)
        try:
            js = client.jetstream()
            config = ConsumerConfig(
                durable_name=self.durable,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.ack_wait,
                max_deliver=self.max_deliver,
                filter_subject=self.subject or None,
            )
            # Created if missing, else its settings brought up to date.
            await js.add_consumer(self.stream, config)
            subscription = await js.pull_subscribe_bind(durable=self.durable, stream=self.stream)
        except BaseException:
            await client.close()
            raise
        return client, subscription

    def close(self) -> None:
        client, self._client, self._subscription = self._client, None, None
        if client is not None:
            try:
                # Drain: acknowledgements still buffered reach the server.
                self._loop.run(client.drain(), 5)
            except Exception as exc:
                logger.debug("Closing the NATS consumer's connection: %s", exc)
        self._loop.stop()

    # Consuming -----------------------------------------------------------------------

    def poll(self, timeout: float = 1.0) -> int:
        """Fetch up to ``batch`` messages (waiting up to ``timeout`` seconds for the first)
        and handle each; return how many were fetched."""
        self.open()
        try:
            fetched = self._loop.run(self._subscription.fetch(self.batch, timeout), timeout + 5)
        except nats.errors.TimeoutError:
            return 0
        for message in fetched:
            if self.stopping.is_set():
                # Not handled: given back at once rather than after ack_wait.
                self._loop.run(message.nak(), 5)
                continue
            self.handle(message)
        return len(fetched)

    def handle(self, message: Any) -> None:
        """Handle one delivery exactly once, then acknowledge it (or give it back)."""
        delivered = as_stream_message(message)
        # A connection left broken (the database restarted) is replaced, as a worker would.
        close_old_connections()
        delivery = Delivery(
            consumer=self.consumer,
            message_id=delivered.id,
            name=delivered.subject,
            # The same id with another body is not a redelivery (KeyReused).
            args=(delivered.subject, hashlib.sha256(delivered.data).hexdigest()),
            kwargs={},
            run=lambda: self._run_handler(delivered),
            give_back=_give_back,
            sender=type(self),
            context=delivered,
        )
        try:
            with consume_span_from_headers(
                delivered.headers, delivered.id, delivered.subject, NATS
            ):
                consume(delivery)
        except _GiveBack as exc:
            logger.info("NATS message %s goes back to the stream: %s", delivered.id, exc)
            self._loop.run(message.nak(delay=self.nak_delay), 5)
            return
        except KeyReused:
            # Logged by the core; delivered again it would be refused again.
            self._loop.run(message.term(), 5)
            return
        except Exception:
            logger.exception(
                "The handler of NATS message %s (%s) failed; it is delivered again in %g s.",
                delivered.id,
                delivered.subject,
                self.nak_delay,
            )
            self._loop.run(message.nak(delay=self.nak_delay), 5)
            return
        self._loop.run(message.ack(), 5)

    def _run_handler(self, message: StreamMessage) -> None:
        # Its return value is not kept: a redelivery has nothing to return it to.
        self.handler(message)

    def run(self) -> int:
        """Consume until ``stop()``; return how many messages were fetched."""
        total = 0
        logger.info(
            "NATS consumer %s started on stream %s (durable %s) at %s.",
            self.consumer,
            self.stream,
            self.durable,
            ", ".join(server.rsplit("@", 1)[-1] for server in self.servers),
        )
        try:
            while not self.stopping.is_set():
                try:
                    total += self.poll()
                except Exception as exc:
                    if not isinstance(exc, UNREACHABLE) and not isinstance(
                        exc.__cause__, UNREACHABLE
                    ):
                        raise
                    logger.warning(
                        "NATS consumer %s: %s: %s", self.consumer, type(exc).__name__, exc
                    )
                    self.close()
                    self.stopping.wait(RECONNECT_PAUSE)
        finally:
            self.close()
        return total

    def stop(self) -> None:
        self.stopping.set()


def as_stream_message(message: Any) -> StreamMessage:
    metadata = message.metadata
    headers = dict(message.headers or {})
    sequence = int(metadata.sequence.stream)
    return StreamMessage(
        subject=message.subject,
        data=bytes(message.data),
        headers=headers,
        id=headers.get(MSG_ID) or f"{metadata.stream}:{sequence}",
        stream=metadata.stream,
        sequence=sequence,
        delivered=int(metadata.num_delivered),
    )
