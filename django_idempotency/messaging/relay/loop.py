"""The relay's loop: passes that claim, publish and mark (``leases``, ``destinations``), LISTEN
for commits, back off, warn of an old backlog and time the redrive (``docs/outbox.md``).

Over 400 lines as one concern: ``Relay`` is one loop whose passes, waits and pipelined claims
share its state; split, each part would reach into the others."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, router
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.messaging.destinations import (
    Destination,
    Destinations,
    PublishResult,
    Waiting,
    start,
)
from django_idempotency.messaging.outbox import CHANNEL, leases
from django_idempotency.messaging.outbox.leases import Batch, Message
from django_idempotency.messaging.relay.heartbeats import BEAT_EVERY, Heartbeat
from django_idempotency.messaging.relay.redrive import Redrive
from django_idempotency.models import OutboxMessage

logger = logging.getLogger("django_idempotency.relay")

# The relay's own pause after a failed pass (broker or database down), doubling up to the poll.
FIRST_PAUSE = 0.1
# How often the relay looks at its backlog's age, and says that it is old, while it is.
BACKLOG_CHECK_EVERY = 10.0
BACKLOG_LOG_EVERY = 60.0


@dataclass
class PassResult:
    """What one claim-publish-mark pass did."""

    claimed: int = 0
    published: int = 0
    marked: int = 0
    failed: int = 0
    error: str = ""
    ids: list[str] = field(default_factory=list)
    # When each of ``ids`` was enqueued (its row's created_at).
    enqueued: list[datetime] = field(default_factory=list)
    # Whether a message with an ordering key went out: the next of its key may now go.
    keyed: bool = False


def default_owner() -> str:
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Relay:
    """Publishes the outbox of one database; ``run()`` loops, ``drain()`` empties it once."""

    def __init__(
        self,
        *,
        using: str | None = None,
        app: Any = None,
        batch_size: int | None = None,
        owner: str | None = None,
    ) -> None:
        self.using = using or router.db_for_write(OutboxMessage)
        # ``app``: the Celery app of the Celery destinations that name none of their own.
        self.destinations = Destinations(app=app)
        self.batch_size = batch_size or conf.OUTBOX_BATCH_SIZE
        self.owner = owner or default_owner()
        self.redrive = Redrive(self.using, self.destinations)
        self.stopping = threading.Event()
        self.heartbeat = Heartbeat(self.using, self.owner, timezone.now())
        self._listener: Any = None
        self._backlog_checked = self._backlog_logged = self._redrive_checked = -math.inf

    # The outbox rows (leases) -------------------------------------------------------

    def claim(self, limit: int | None = None) -> Batch:
        """Lease up to ``limit`` unpublished rows, oldest first, and commit the lease."""
        return leases.claim(self.using, owner=self.owner, limit=limit or self.batch_size)

    def mark(self, batch: Batch, messages: tuple[Message, ...]) -> int:
        """Mark published the rows this relay still holds; return how many it could."""
        if not messages:
            return 0
        # Those whose exactly-once consumer's record the redrive checks later.
        check = self.redrive.to_check(m for m in messages if self.destinations.of(m).redrives)
        after = self.redrive.after or timedelta(0)
        return leases.mark(self.using, batch, messages, owner=self.owner, check=check, after=after)

    def fail(self, batch: Batch, message: Message, error: str, *, hold: bool = True) -> None:
        """Count a failed publish and, with ``hold``, hold the row back for a while (or for
        good: a dead letter, after IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS tries)."""
        if leases.fail(self.using, batch, message, error, owner=self.owner, hold=hold):
            logger.error(
                "Outbox message %s (%s) failed to publish %d times and is now a dead letter: "
                "it is kept and not tried again until requeued (the admin, or manage.py "
                "idempotency_outbox requeue --id %s). Last error: %s",
                message.id,
                message.name,
                conf.OUTBOX_MAX_ATTEMPTS,
                message.id,
                error,
            )

    def release(self, batch: Batch, messages: tuple[Message, ...]) -> None:
        """Give rows back untried, for the next pass of any relay."""
        leases.release(self.using, batch, messages, owner=self.owner)

    # Passes -------------------------------------------------------------------------

    def run_pass(self) -> PassResult:
        """Claim one batch, publish it in order, mark what was published."""
        batch = self.claim()
        if not batch.messages:
            return PassResult()
        return self.settle(batch, self.publish(batch))

    def publish(self, batch: Batch) -> list[tuple[Destination, Waiting]]:
        """Start publishing the batch: each destination its own messages, in order (in the
        background where it can); one that fails stops none other. Each stops early when
        half the batch's lease has gone, so that what it sent is marked while the lease
        holds: a destination slower than the lease (a round trip per message) still makes
        progress, instead of publishing the same batch again and again unmarked."""
        until = LeaseDeadline(
            self.stopping, batch.claimed_at + conf.OUTBOX_LEASE.total_seconds() / 2
        )
        return [
            (destination, start(destination, messages, until))
            for destination, messages in self.destinations.split(batch.messages)
        ]

    def settle(self, batch: Batch, started: list[tuple[Destination, Waiting]]) -> PassResult:
        """Wait for the batch's publication, mark what was published, hold back or give back
        the rest."""
        result = PassResult(claimed=len(batch.messages))
        published: list[Message] = []
        failures: list[tuple[Destination, Message, Exception]] = []
        try:
            for destination, wait in started:
                done = wait()
                published += done.sent
                if done.failed is not None and done.error is not None:
                    failures.append((destination, done.failed, done.error))
        finally:
            sent = tuple(published)
            result.published = len(sent)
            result.marked = self.mark(batch, sent)
            result.ids = [m.id for m in sent]
            result.enqueued = [m.created_at for m in sent]
            result.keyed = any(m.ordering_key is not None for m in sent)
        if result.marked < result.published:
            logger.warning(
                "Relay %s lost its lease on %d of %d published outbox rows before marking "
                "them: they will be published again with the same task ids.",
                self.owner,
                result.published - result.marked,
                result.published,
            )
        done_ids = {m.id for m in sent}
        for destination, failed, error in failures:
            result.failed += 1
            result.error = f"{type(error).__name__}: {error}"
            unreachable = destination.is_connection_error(error)
            destination.close()
            logger.warning("Publishing outbox message %s failed: %s", failed.id, result.error)
            # A destination that is down is no fault of the message: the relay pauses instead,
            # so that every message goes out as soon as it is back.
            self.fail(batch, failed, result.error, hold=not unreachable)
            done_ids.add(failed.id)
        # Untried, or sent in a batch whose delivery is unknown: back for the next pass.
        self.release(batch, tuple(m for m in batch.messages if m.id not in done_ids))
        if result.ids:
            signals.outbox_published.send_robust(
                Relay, ids=result.ids, enqueued=result.enqueued, using=self.using
            )
        self.heartbeat.count(published=result.marked, failed=result.failed, error=result.error)
        return result

    def drain(self) -> int:
        """Run passes until a pass claims less than a full batch (and published no keyed
        message, whose successor a claim takes only once it is marked) or fails; return how
        many rows were published."""
        total = 0
        while not self.stopping.is_set():
            published, keyed = self._drain_pipelined()
            total += published
            if not keyed:
                break
        return total

    def _drain_pipelined(self) -> tuple[int, bool]:
        """Claim, publish and mark batches until one is not full; return how many rows were
        published and whether any of them had an ordering key.

        Pipelined on PostgreSQL: while a batch is in flight (a destination with
        ``publish_later``), the relay marks the one before, and a thread of its own, on a
        database connection of its own, claims the next; so the database's two statements a
        batch overlap the publish. A batch goes out only once the one before is acknowledged,
        and never after a failure (it is given back untried): the order is that of one pass
        at a time, and a row is still marked only once it was acknowledged."""
        total = 0
        keyed = False
        claims: ThreadPoolExecutor | None = None
        upcoming: Future[Batch] | None = None
        # Batches published and not yet marked, oldest first: at most the one in flight and
        # the one before it.
        unsettled: list[tuple[Batch, list[tuple[Destination, Waiting]]]] = []
        try:
            batch = self.claim()
            while batch.messages:
                if self._full(batch):
                    claims = claims or self._claims()
                    upcoming = self._claim_ahead(claims)
                unsettled.append((batch, self.publish(batch)))
                if len(unsettled) > 1:
                    # The one before, marked while this one is in flight.
                    settled = self.settle(*unsettled.pop(0))
                    total += settled.published
                    keyed = keyed or settled.keyed
                # Its acknowledgements before the next batch goes out.
                started = unsettled[0][1]
                outcomes = [(destination, _done(wait())) for destination, wait in started]
                unsettled[0] = (batch, outcomes)
                batch = Batch(0, ())
                if upcoming is not None:
                    batch, upcoming = upcoming.result(), None
                    if any(wait().failed is not None for _, wait in outcomes):
                        self.release(batch, batch.messages)
                        batch = Batch(0, ())
            if unsettled:
                result = self.settle(*unsettled.pop(0))
                total += result.published
                keyed = keyed or result.keyed
                if result.failed:
                    raise PublishFailed(result.error)
        finally:
            # Something raised: what is in flight is waited for and marked, what was claimed
            # and not published is given back (else its lease would hold it for a while).
            for batch, started in unsettled:
                with contextlib.suppress(Exception):
                    self.settle(batch, started)
            if upcoming is not None:
                with contextlib.suppress(Exception):
                    following = upcoming.result()
                    self.release(following, following.messages)
            if claims is not None:
                # Its database connection is its thread's own: closed there.
                claims.submit(lambda: connections[self.using].close()).result()
                claims.shutdown()
        return total, keyed

    def _full(self, batch: Batch) -> bool:
        return len(batch.messages) >= self.batch_size and not self.stopping.is_set()

    def _claim_ahead(self, claims: ThreadPoolExecutor | None) -> Future[Batch]:
        if claims is not None:
            return claims.submit(self.claim)
        claimed: Future[Batch] = Future()
        claimed.set_result(self.claim())
        return claimed

    def _claims(self) -> ThreadPoolExecutor | None:
        """The thread that claims ahead; None (claims in turn) off PostgreSQL, where a
        second connection would wait for the first's lock or see another database."""
        if connections[self.using].vendor != "postgresql":
            return None
        return ThreadPoolExecutor(1, thread_name_prefix="outbox-relay-claims")

    # Waiting ------------------------------------------------------------------------

    def listen(self) -> None:
        """LISTEN on a connection of its own, in autocommit: notifies arrive between passes."""
        wrapper = connections[self.using]
        if self._listener is not None or wrapper.vendor != "postgresql":
            return
        listener = wrapper.get_new_connection(wrapper.get_connection_params())
        listener.autocommit = True
        listener.execute(f"LISTEN {CHANNEL}")
        self._listener = listener

    def close_listener(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(Exception):
                self._listener.close()
        self._listener = None

    def wait(self, timeout: float) -> bool:
        """Wait for a commit in the outbox (True) or ``timeout`` seconds (False)."""
        if self._listener is None:
            self.stopping.wait(timeout)
            return False
        deadline = time.monotonic() + timeout
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # Short slices, so that stop() is noticed; every pending notify is taken at once.
            woken = False
            try:
                for _ in self._listener.notifies(timeout=min(left, 0.5), stop_after=1):
                    woken = True
                if woken:
                    # Take the rest too: one pass serves every commit so far. The database
                    # can go away between the two (a failover right after a commit).
                    for _ in self._listener.notifies(timeout=0):
                        pass
            except Exception as exc:  # the database went away: poll until it is back
                logger.warning("Relay %s lost its LISTEN connection: %s", self.owner, exc)
                self.close_listener()
                return True
            if woken:
                return True
        return False

    def redrive_if_due(self) -> int:
        """Every little while, put back for publishing the published messages that their
        exactly-once consumers have no record of (``redrive``); return how many."""
        if self.redrive.after is None:
            return 0
        if time.monotonic() - self._redrive_checked < self.redrive.check_every:
            return 0
        self._redrive_checked = time.monotonic()
        again = 0
        while not self.stopping.is_set():
            result = self.redrive.run_pass(self.batch_size)
            again += len(result.republished)
            if result.checked < self.batch_size:
                break
        return again

    def warn_if_backlog_is_old(self) -> None:
        # Not on every wake-up: a busy relay passes many times a second.
        if time.monotonic() - self._backlog_checked < BACKLOG_CHECK_EVERY:
            return
        self._backlog_checked = time.monotonic()
        oldest = leases.oldest_pending(self.using)
        if oldest is None or timezone.now() - oldest <= conf.OUTBOX_MAX_AGE:
            return
        if time.monotonic() - self._backlog_logged >= BACKLOG_LOG_EVERY:
            self._backlog_logged = time.monotonic()
            logger.warning(
                "The oldest unpublished outbox message was written at %s, more than %s ago.",
                oldest.isoformat(),
                conf.OUTBOX_MAX_AGE,
            )

    def run(self, *, once: bool = False) -> int:
        """Publish until stopped (or, with ``once``, until the outbox is empty)."""
        total = 0
        pause = FIRST_PAUSE
        named = len(self.destinations.by_name) > 1
        logger.info(
            "Relay %s started on database %r; it publishes with %s.",
            self.owner,
            self.using,
            "; ".join(f"{d.name}: " * named + d.describe() for d in self.destinations),
        )
        self.redrive.import_tasks()
        beating = False
        try:
            while not self.stopping.is_set():
                try:
                    if not beating:
                        self.heartbeat.start()
                        beating = True
                    # Listen before draining: a commit made during the drain still wakes us.
                    self.listen()
                    total += self.drain()
                    if self.redrive_if_due():
                        total += self.drain()
                    self.warn_if_backlog_is_old()
                    self.heartbeat.beat()
                # Anything: the broker or the database gone (psycopg's own errors come from the
                # listener, which Django does not wrap), a bug in a receiver. Keep going.
                except Exception as exc:
                    self._recover(exc)
                    if once:  # a one-off run (cron, a deploy step) reports and exits
                        raise
                    # Alive if failing (its last error says why); no beat if the database
                    # is what failed.
                    if beating:
                        with contextlib.suppress(Exception):
                            self.heartbeat.beat()
                    self.stopping.wait(pause)
                    pause = min(pause * 2, conf.OUTBOX_POLL_INTERVAL.total_seconds())
                    continue
                pause = FIRST_PAUSE
                if once:
                    break
                poll = conf.OUTBOX_POLL_INTERVAL.total_seconds()
                if self.redrive.after is not None:
                    # No commit announces that a redrive check is due.
                    poll = min(poll, self.redrive.check_every)
                # Idle, it still beats.
                self.wait(min(poll, BEAT_EVERY))
        finally:
            self.close_listener()
            self.destinations.close()
            if beating:  # a clean stop: its row goes (a database gone keeps it, stale)
                with contextlib.suppress(Exception):
                    self.heartbeat.stop()
        logger.info("Relay %s stopped; it published %d messages.", self.owner, total)
        return total

    def _recover(self, exc: Exception) -> None:
        logger.warning("Relay %s: %s: %s", self.owner, type(exc).__name__, exc)
        if not isinstance(exc, PublishFailed):
            # A lost database: reconnect everything on the next pass.
            self.close_listener()
            with contextlib.suppress(Exception):
                connections[self.using].close()

    def stop(self) -> None:
        self.stopping.set()


def _done(result: PublishResult) -> Waiting:
    return lambda: result


class LeaseDeadline:
    """Set once the relay stops or the batch's publishing time is up (``time.monotonic()``)."""

    def __init__(self, stopping: threading.Event, deadline: float) -> None:
        self.stopping = stopping
        self.deadline = deadline

    def is_set(self) -> bool:
        return self.stopping.is_set() or time.monotonic() >= self.deadline


class PublishFailed(Exception):
    """A publish to the broker failed; the row was held back and the pass ended."""
