"""The NATS JetStream destination: each message published with its message id as
``Nats-Msg-Id`` (the stream drops a duplicate within its window), counted as sent only once
the stream has acknowledged it; nats-py's asyncio client runs on a loop of its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.messaging.destinations import Destination, PublishResult, Stopping
from django_idempotency.messaging.nats_client import (
    CONNECT,
    DEFAULTS,
    MSG_ID,
    UNREACHABLE,
    ClientLoop,
    result,
)
from django_idempotency.messaging.outbox.leases import Message
from django_idempotency.messaging.tracing import NATS, publish_span
from django_idempotency.models import OutboxMessage

# Where the message must land (JetStream refuses the publish otherwise).
EXPECTED_STREAM = "Nats-Expected-Stream"


# One encoder for every body: json.dumps() with separators builds one a call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def body(message: Message) -> bytes:
    """What a consumer reads: an event's payload; a task's ``{"args": ..., "kwargs": ...}``."""
    if message.kind == OutboxMessage.Kind.EVENT:
        document: Any = message.payload
    else:
        document = {"args": message.args, "kwargs": message.kwargs}
    return _encode(document).encode()


class NatsDestination(Destination):
    """Publishes to NATS JetStream, on the subject ``OPTIONS["subject"]`` names."""

    pipelines = True

    def __init__(self, name: str, options: Mapping[str, Any], *, app: Any = None) -> None:
        self.name = name
        chosen = {**DEFAULTS, **options}
        servers = chosen["servers"]
        self.servers: list[str] = [servers] if isinstance(servers, str) else list(servers)
        self.subject: str = chosen["subject"]
        self.stream: str | None = chosen["stream"]
        self.ack_timeout = float(chosen["ack_timeout"])
        self.connect_options = {**CONNECT, **chosen["connect"]}
        self._loop = ClientLoop(f"outbox-nats-{name}")
        self._client: Any = None
        # Replies to publishes come to <inbox>.<token>: one subscription for them all.
        self._inbox = ""
        self._replies: dict[str, asyncio.Future[None]] = {}
        self._tokens = itertools.count()

    @classmethod
    def validate(cls, name: str, options: Mapping[str, Any]) -> None:
        unknown = set(options) - set(DEFAULTS)
        subject = options.get("subject", DEFAULTS["subject"])
        problem = ""
        if unknown:
            problem = f"unknown OPTIONS {sorted(unknown)} (it takes {', '.join(DEFAULTS)})"
        elif not options.get("servers", DEFAULTS["servers"]):
            problem = "no servers"
        elif not isinstance(subject, str):
            problem = f"a subject that is no str: {subject!r}"
        else:
            try:
                subject.format(name="x", kind="task")
            except (KeyError, IndexError, ValueError) as exc:
                problem = f"a subject with an unknown field ({exc}): it may use {{name}}, {{kind}}"
        if problem:
            raise ImproperlyConfigured(f"The NATS outbox destination {name!r} has {problem}.")

    def describe(self) -> str:
        # Servers as given, less any credentials before an "@".
        shown = [server.rsplit("@", 1)[-1] for server in self.servers]
        return f"NATS JetStream at {', '.join(shown)}"

    def open(self) -> None:
        if self._client is not None:
            return
        timeout = float(self.connect_options.get("connect_timeout", 2)) * len(self.servers) + 1
        self._client = self._loop.run(self._connect(), timeout)

    async def _connect(self) -> Any:
        client = await nats.connect(servers=self.servers, **self.connect_options)
        self._inbox = client.new_inbox()
        self._replies.clear()
        await client.subscribe(f"{self._inbox}.*", cb=self._reply)
        return client

    async def _reply(self, reply: Any) -> None:
        """The stream's answer to one publish: an acknowledgement, or why it refused it.
        (nats-py's own publish_async leaves a refusal unanswered until it times out.)"""
        future = self._replies.pop(reply.subject.rsplit(".", 1)[-1], None)
        if future is None or future.done():
            return
        if (reply.headers or {}).get("Status") == "503":  # no stream took the subject
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        answer = json.loads(reply.data)
        if "error" not in answer:
            future.set_result(None)
            return
        try:
            nats.js.errors.APIError.from_error(answer["error"])  # raises the matching error
        except nats.js.errors.APIError as refusal:
            future.set_exception(refusal)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                self._loop.run(client.close(), self.ack_timeout)
        self._loop.stop()

    def is_connection_error(self, exc: Exception) -> bool:
        return isinstance(exc, UNREACHABLE) or isinstance(exc.__cause__, UNREACHABLE)

    # Publishing ---------------------------------------------------------------------------

    def subject_of(self, message: Message) -> str:
        kind = "event" if message.kind == OutboxMessage.Kind.EVENT else "task"
        return self.subject.format(name=message.name, kind=kind)

    def publish(self, messages: Sequence[Message], stopping: Stopping) -> PublishResult:
        """Send the whole batch, then wait for the stream's acknowledgements: sent are those
        acknowledged (a duplicate the stream dropped counts: it has the message)."""
        return self.publish_later(messages, stopping)()

    def publish_later(
        self, messages: Sequence[Message], stopping: Stopping
    ) -> Callable[[], PublishResult]:
        """Start sending the batch on the client's loop and return at once the wait for its
        acknowledgements (bounded), so that the relay marks and claims meanwhile."""
        self.open()
        chosen = [m for m in messages if not stopping.is_set()]
        future = self._loop.submit(self._publish(chosen))

        def wait() -> PublishResult:
            outcomes = result(future, self.ack_timeout + 5)
            done = PublishResult()
            for message, outcome in zip(chosen, outcomes, strict=True):
                if outcome is None:
                    done.sent.append(message)
                elif done.failed is None:
                    done.failed, done.error = message, outcome
            return done

        return wait

    async def _publish(self, messages: list[Message]) -> list[Exception | None]:
        client = self._client
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[None]] = []
        unsent: list[Exception | None] = []
        try:
            for message in messages:
                token = str(next(self._tokens))
                future: asyncio.Future[None] = loop.create_future()
                self._replies[token] = future
                futures.append(future)
                # In order, each written before the next; the acknowledgements come back
                # while the rest is sent.
                subject = self.subject_of(message)
                with publish_span(message.id, subject, message.options, self.name, NATS) as traced:
                    headers = {**traced, MSG_ID: message.id}
                    if self.stream is not None:
                        headers[EXPECTED_STREAM] = self.stream
                    await client.publish(
                        subject, body(message), reply=f"{self._inbox}.{token}", headers=headers
                    )
        except Exception as exc:  # the connection went: the rest is not sent
            futures[-1].set_exception(exc)
            unsent = [exc] * (len(messages) - len(futures))
        if futures:
            await asyncio.wait(futures, timeout=self.ack_timeout)
        outcomes: list[Exception | None] = []
        for future in futures:
            if not future.done():
                future.cancel()
                outcomes.append(TimeoutError("no acknowledgement from the stream in time"))
            else:
                error = future.exception()
                outcomes.append(error if isinstance(error, Exception) else None)
        self._replies.clear()
        return outcomes + unsent
