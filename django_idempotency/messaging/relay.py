"""The relay: claims committed outbox rows, publishes them to the broker, marks them published.

A claim leases a batch (``FOR UPDATE SKIP LOCKED``, so relays running at once take different
rows) and stamps it with a new fence from a sequence, then commits: nothing is locked while
the broker is talked to. Marking requires the relay's own fence and a lease still running,
so a relay that stalled past its lease, whose rows another relay took over, marks nothing.
Publishing happens before marking: a relay that dies in between publishes the rows again
after the lease runs out, with the same task ids (at least once). A message for an
exactly-once task that its consumer never recorded (the broker lost it) is published again
by the redrive (``redrive.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router, transaction
from django.db.models import Case, DateTimeField, Min, Q, Value, When
from django.utils import timezone
from django.utils.module_loading import import_string

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.messaging.outbox import CHANNEL, TABLE, task_name
from django_idempotency.messaging.redrive import CHECK_AT_SQL, Redrive, check_at
from django_idempotency.models import OutboxMessage

if TYPE_CHECKING:
    from django_idempotency.messaging.publishing import TaskSender

logger = logging.getLogger("django_idempotency.relay")

FENCE_SEQUENCE = "django_idempotency_outbox_fence"
# A row whose publish failed waits 1, 2, 4 ... seconds, at most this long, before the next try.
MAX_BACKOFF = timedelta(minutes=5)
# The relay's own pause after a failed pass (broker or database down), doubling up to the poll.
FIRST_PAUSE = 0.1
# How often the relay looks at its backlog's age, and says that it is old, while it is.
BACKLOG_CHECK_EVERY = 10.0
BACKLOG_LOG_EVERY = 60.0

CLAIM = f"""
WITH batch AS (
    SELECT id, created_at FROM {TABLE}
     WHERE published_at IS NULL AND (lease_until IS NULL OR lease_until < now())
     -- The id breaks ties of one millisecond, so that a batch boundary never takes a later
     -- message of that millisecond before an earlier one.
     ORDER BY created_at, id
     LIMIT %s
       FOR UPDATE SKIP LOCKED
), next_fence AS (
    SELECT nextval('{FENCE_SEQUENCE}') AS value
), claimed AS (
    UPDATE {TABLE} AS o
       SET lease_owner = %s, lease_until = now() + %s, fence = next_fence.value
      FROM batch, next_fence
     WHERE o.id = batch.id AND o.created_at = batch.created_at
    RETURNING o.id, o.created_at, o.kind, o.name, o.args, o.kwargs, o.payload, o.options, o.fence,
              o.redrives
)
-- In the order written (UPDATE ... RETURNING has none; ids are time-ordered, compared as
-- uuids, not as the text returned); the JSON columns as one document, decoded once a row.
SELECT id::text, created_at, kind, name, jsonb_build_array(args, kwargs, payload, options)::text,
       fence, redrives
  FROM claimed
 ORDER BY claimed.created_at, claimed.id
"""

# created_at bounds prune the statement to the batch's partitions.
MARK = f"""
UPDATE {TABLE} SET published_at = now(), lease_until = NULL, redrive_at = {CHECK_AT_SQL}
 WHERE id = ANY(%s::uuid[]) AND created_at BETWEEN %s AND %s
   AND lease_owner = %s AND fence = %s AND lease_until > now() AND published_at IS NULL
"""

FAIL = f"""
UPDATE {TABLE}
   SET attempts = attempts + 1, last_error = %s, lease_owner = '',
       lease_until = CASE WHEN %s
           THEN now() + interval '1 second' * least(power(2, least(attempts, 20)), %s) END
 WHERE id = %s AND created_at = %s AND lease_owner = %s AND fence = %s
"""

RELEASE = f"""
UPDATE {TABLE} SET lease_owner = '', lease_until = NULL
 WHERE id = ANY(%s::uuid[]) AND created_at BETWEEN %s AND %s AND lease_owner = %s
   AND fence = %s AND published_at IS NULL
"""


@dataclass(frozen=True)
class Message:
    """A claimed outbox row, as the relay publishes it."""

    id: str
    created_at: datetime
    kind: int
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    payload: Any
    options: dict[str, Any]
    # How often the redrive put it back to be published again.
    redrives: int = 0


@dataclass(frozen=True)
class Batch:
    """Rows leased by one claim, all under the same fence."""

    fence: int
    messages: tuple[Message, ...]

    def bounds(self, messages: tuple[Message, ...] | None = None) -> list[Any]:
        chosen = self.messages if messages is None else messages
        return [
            [m.id for m in chosen],
            min(m.created_at for m in chosen),
            max(m.created_at for m in chosen),
        ]


@dataclass
class PassResult:
    """What one claim-publish-mark pass did."""

    claimed: int = 0
    published: int = 0
    marked: int = 0
    failed: int = 0
    error: str = ""
    ids: list[str] = field(default_factory=list)


def _documents(text: str) -> tuple[list[Any], dict[str, Any], Any, dict[str, Any]]:
    """A claimed row's args, kwargs, payload and options, sent as one JSON document."""
    args, kwargs, payload, options = json.loads(text)
    return args, kwargs, payload, options


def celery_app() -> Any:
    """The Celery app the relay publishes with: ``IDEMPOTENCY_OUTBOX_CELERY_APP``, else the
    current app, the project's once its ``celery.py`` is imported. Never Celery's own
    default app, whose broker no worker of the project reads (ImproperlyConfigured)."""
    path = conf.OUTBOX_CELERY_APP
    if path:
        app = import_string(path)
    else:
        from celery import current_app

        app = current_app._get_current_object()  # type: ignore[attr-defined]
    if celerys_default(app):
        raise ImproperlyConfigured(
            f"The relay's Celery app is Celery's default app ({app.main!r}, broker "
            f"{broker_of(app)}), not the project's: the project's celery.py was never "
            "imported, so the relay would publish where no worker of the project reads. "
            "Import it in the project package's __init__.py (`from .celery import app as "
            "celery_app`, as Celery's Django guide shows), or set "
            "IDEMPOTENCY_OUTBOX_CELERY_APP to its dotted path, such as "
            '"myproject.celery.app".'
        )
    return app


def celerys_default(app: Any) -> bool:
    """Whether ``app`` is the app Celery makes for itself when none was made (or set as
    current in this thread)."""
    from celery import _state

    fallback = getattr(_state, "default_app", None)  # made on first need, so read it now
    return app is fallback and getattr(app, "main", None) == "default"


def broker_of(app: Any) -> str:
    """The app's broker URL to publish to, without its password."""
    # A Connection is only a description until it is used: nothing connects here.
    return str(app.connection_for_write().as_uri())


def require_publisher_confirms(app: Any) -> None:
    """On RabbitMQ, publish in confirm mode: a publish returns once the broker has the message.

    Done before the relay opens its connection; Redis answers every command anyway.
    """
    url = str(app.conf.broker_write_url or app.conf.broker_url or "")
    if url.split("://", 1)[0] in {"amqp", "pyamqp", "amqps"}:
        options = dict(app.conf.broker_transport_options or {})
        options.setdefault("confirm_publish", True)
        app.conf.broker_transport_options = options


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
        self.app = app if app is not None else celery_app()
        require_publisher_confirms(self.app)
        self.batch_size = batch_size or conf.OUTBOX_BATCH_SIZE
        self.owner = owner or default_owner()
        self.redrive = Redrive(self.app, self.using)
        self.stopping = threading.Event()
        self._connection: Any = None
        self._producer: Any = None
        self._listener: Any = None
        self._backlog_checked = self._backlog_logged = self._redrive_checked = -math.inf

    # Database -----------------------------------------------------------------------

    @property
    def _postgresql(self) -> bool:
        return connections[self.using].vendor == "postgresql"

    def claim(self, limit: int | None = None) -> Batch:
        """Lease up to ``limit`` unpublished rows, oldest first, and commit the lease."""
        limit = limit or self.batch_size
        with transaction.atomic(using=self.using):
            if not self._postgresql:
                return self._claim_portable(limit)
            with connections[self.using].cursor() as cursor:
                lease: Any = conf.OUTBOX_LEASE  # psycopg sends a timedelta as an interval
                cursor.execute(CLAIM, [limit, self.owner, lease])
                rows = cursor.fetchall()
        if not rows:
            return Batch(0, ())
        # The database hands jsonb over as text (Django's choice): one document per row.
        messages = tuple(
            Message(r[0], r[1], r[2], r[3], *_documents(r[4]), redrives=r[6]) for r in rows
        )
        return Batch(int(rows[0][5]), messages)

    def _claim_portable(self, limit: int) -> Batch:
        # Without SKIP LOCKED and sequences (SQLite, a development fallback): the database
        # serialises writers, and a fence above every claimed row's still moves every row on.
        now = timezone.now()
        pending = OutboxMessage.objects.using(self.using).filter(
            Q(lease_until__isnull=True) | Q(lease_until__lt=now), published_at__isnull=True
        )
        rows = list(pending.order_by("created_at", "id")[:limit])
        if not rows:
            return Batch(0, ())
        fence = max(r.fence for r in rows) + 1
        OutboxMessage.objects.using(self.using).filter(pk__in=[r.pk for r in rows]).update(
            lease_owner=self.owner, lease_until=now + conf.OUTBOX_LEASE, fence=fence
        )
        return Batch(
            fence,
            tuple(
                Message(
                    str(r.id),
                    r.created_at,
                    r.kind,
                    r.name,
                    r.args,
                    r.kwargs,
                    r.payload,
                    r.options,
                    r.redrives,
                )
                for r in rows
            ),
        )

    def mark(self, batch: Batch, messages: tuple[Message, ...]) -> int:
        """Mark published the rows this relay still holds; return how many it could."""
        if not messages:
            return 0
        # Those whose exactly-once consumer's record the redrive checks later.
        check = self.redrive.to_check(messages)
        after = self.redrive.after or timedelta(0)
        with transaction.atomic(using=self.using):
            if self._postgresql:
                params: list[Any] = [check, after, *batch.bounds(messages)]
                with connections[self.using].cursor() as cursor:
                    cursor.execute(MARK, [*params, self.owner, batch.fence])
                    return int(cursor.rowcount)
            now = timezone.now()
            checked = set(check)
            ids = {m.id: uuid.UUID(m.id) for m in messages}
            # MARK's CHECK_AT_SQL, in the same one UPDATE: each row's own check time.
            redrive_at = Case(
                *(
                    When(pk=ids[m.id], then=Value(check_at(m, now, after)))
                    for m in messages
                    if m.id in checked
                ),
                default=Value(None),
                output_field=DateTimeField(),
            )
            return (
                OutboxMessage.objects.using(self.using)
                .filter(
                    pk__in=list(ids.values()),
                    lease_owner=self.owner,
                    fence=batch.fence,
                    lease_until__gt=now,
                    published_at__isnull=True,
                )
                .update(published_at=now, lease_until=None, redrive_at=redrive_at)
            )

    def fail(self, batch: Batch, message: Message, error: str, *, hold: bool = True) -> None:
        """Count a failed publish and, with ``hold``, hold the row back for a while."""
        with transaction.atomic(using=self.using):
            if self._postgresql:
                with connections[self.using].cursor() as cursor:
                    cursor.execute(
                        FAIL,
                        [
                            error[:2000],
                            hold,
                            MAX_BACKOFF.total_seconds(),
                            uuid.UUID(message.id),
                            message.created_at,
                            self.owner,
                            batch.fence,
                        ],
                    )
                return
            row = OutboxMessage.objects.using(self.using).filter(
                pk=uuid.UUID(message.id), lease_owner=self.owner, fence=batch.fence
            )
            for found in row:
                delay = min(timedelta(seconds=2 ** min(found.attempts, 20)), MAX_BACKOFF)
                row.update(
                    attempts=found.attempts + 1,
                    last_error=error[:2000],
                    lease_owner="",
                    lease_until=timezone.now() + delay if hold else None,
                )

    def release(self, batch: Batch, messages: tuple[Message, ...]) -> None:
        """Give rows back untried, for the next pass of any relay."""
        if not messages:
            return
        with transaction.atomic(using=self.using):
            if self._postgresql:
                with connections[self.using].cursor() as cursor:
                    cursor.execute(RELEASE, [*batch.bounds(messages), self.owner, batch.fence])
                return
            OutboxMessage.objects.using(self.using).filter(
                pk__in=[uuid.UUID(m.id) for m in messages],
                lease_owner=self.owner,
                fence=batch.fence,
                published_at__isnull=True,
            ).update(lease_owner="", lease_until=None)

    def oldest_pending(self) -> datetime | None:
        found = OutboxMessage.objects.using(self.using).filter(published_at__isnull=True)
        oldest: datetime | None = found.aggregate(oldest=Min("created_at"))["oldest"]
        return oldest

    # Broker -------------------------------------------------------------------------

    def producer(self) -> Any:
        """One producer on one connection, kept between passes and replaced after an error."""
        if self._producer is None:
            self._connection = self.app.connection_for_write()
            self._connection.ensure_connection(max_retries=1)
            self._producer = self.app.amqp.Producer(self._connection, auto_declare=False)
        return self._producer

    def sender(self) -> TaskSender:
        """What publishes on the producer; made once per pass."""
        # Imported here: Celery is an optional extra, needed only once the relay publishes.
        from django_idempotency.messaging.publishing import TaskSender

        return TaskSender(self.app, self.producer())

    def close_producer(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
        self._connection = self._producer = None

    def _is_connection_error(self, exc: Exception) -> bool:
        from kombu.exceptions import OperationalError

        errors: tuple[type[BaseException], ...] = (OperationalError, OSError)
        if self._connection is not None:
            errors += tuple(self._connection.connection_errors)
        # A failed Redis pipeline wraps the connection error that failed it.
        return isinstance(exc, errors) or isinstance(exc.__cause__, errors)

    def publish(self, message: Message, sender: TaskSender) -> None:
        if message.kind == OutboxMessage.Kind.EVENT:
            args, kwargs = [message.name, message.payload], {}
        else:
            args, kwargs = message.args, message.kwargs
        name = task_name(message.kind, message.name)
        countdown = message.options.get("countdown")
        # From the enqueue, not from now: a relay that was late does not delay it further.
        eta = None if countdown is None else message.created_at + timedelta(seconds=countdown)
        sender.send(
            name, args, kwargs, task_id=message.id, queue=message.options.get("queue"), eta=eta
        )

    # Passes -------------------------------------------------------------------------

    def publish_all(
        self, messages: tuple[Message, ...]
    ) -> tuple[list[Message], Message | None, Exception | None]:
        """Publish in order until one fails: (published, the one that failed, its error).

        Where the transport can (Redis), the publishes go out as one pipeline when the loop
        ends; if that fails, whether any arrived is unknown, so none counts as published.
        """
        sent: list[Message] = []
        failed: Message | None = None
        error: Exception | None = None
        producer = self.producer()
        sender = self.sender()
        batching = getattr(producer, "batch", None)  # kombu 5.7+
        # Large enough that the batch is flushed once, at the end.
        context = (
            batching(max_size=4 * len(messages) + 16) if batching else contextlib.nullcontext()
        )
        try:
            with context:
                for message in messages:
                    if self.stopping.is_set():
                        break
                    try:
                        self.publish(message, sender)
                    except Exception as exc:
                        failed, error = message, exc
                        break
                    sent.append(message)
        except Exception as exc:
            if not sent:
                raise
            return [], sent[0], exc
        return sent, failed, error

    def run_pass(self) -> PassResult:
        """Claim one batch, publish it in order, mark what was published."""
        result = PassResult()
        batch = self.claim()
        result.claimed = len(batch.messages)
        if not batch.messages:
            return result
        published: list[Message] = []
        failed: Message | None = None
        error: Exception | None = None
        try:
            published, failed, error = self.publish_all(batch.messages)
        except Exception as exc:  # connecting failed: nothing went out
            failed, error = batch.messages[0], exc
        finally:
            done = tuple(published)
            result.published = len(done)
            result.marked = self.mark(batch, done)
            result.ids = [m.id for m in done]
        if result.marked < result.published:
            logger.warning(
                "Relay %s lost its lease on %d of %d published outbox rows before marking "
                "them: they will be published again with the same task ids.",
                self.owner,
                result.published - result.marked,
                result.published,
            )
        done_ids = {m.id for m in done}
        if failed is not None and error is not None:
            result.failed = 1
            result.error = f"{type(error).__name__}: {error}"
            broker_down = self._is_connection_error(error)
            self.close_producer()
            logger.warning("Publishing outbox message %s failed: %s", failed.id, result.error)
            # A broker that is down is no fault of the message: the relay pauses instead,
            # so that every message goes out as soon as the broker is back.
            self.fail(batch, failed, result.error, hold=not broker_down)
            done_ids.add(failed.id)
        # Untried, or sent in a batch whose delivery is unknown: back for the next pass.
        self.release(batch, tuple(m for m in batch.messages if m.id not in done_ids))
        if result.ids:
            signals.outbox_published.send_robust(Relay, ids=result.ids, using=self.using)
        return result

    def drain(self) -> int:
        """Run passes until a pass claims less than a full batch or fails; return how many
        rows were published."""
        total = 0
        while not self.stopping.is_set():
            result = self.run_pass()
            total += result.published
            if result.failed or result.claimed < self.batch_size:
                if result.failed:
                    raise PublishFailed(result.error)
                break
        return total

    # Waiting ------------------------------------------------------------------------

    def listen(self) -> None:
        """LISTEN on a connection of its own, in autocommit: notifies arrive between passes."""
        if self._listener is not None or not self._postgresql:
            return
        wrapper = connections[self.using]
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
            except Exception as exc:  # the database went away: poll until it is back
                logger.warning("Relay %s lost its LISTEN connection: %s", self.owner, exc)
                self.close_listener()
                return True
            if woken:
                # Take the rest too: one pass serves every commit so far.
                for _ in self._listener.notifies(timeout=0):
                    pass
                return True
        return False

    def redrive_if_due(self) -> int:
        """Every little while, put back for publishing the published messages that their
        exactly-once consumers have no record of (``messaging/redrive.py``); return how many."""
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
        oldest = self.oldest_pending()
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
        logger.info(
            "Relay %s started on database %r; it publishes with Celery app %r to %s.",
            self.owner,
            self.using,
            self.app.main,
            broker_of(self.app),
        )
        self.redrive.import_tasks()
        try:
            while not self.stopping.is_set():
                try:
                    # Listen before draining: a commit made during the drain still wakes us.
                    self.listen()
                    total += self.drain()
                    if self.redrive_if_due():
                        total += self.drain()
                    self.warn_if_backlog_is_old()
                # Anything: the broker or the database gone (psycopg's own errors come from the
                # listener, which Django does not wrap), a bug in a receiver. Keep going.
                except Exception as exc:
                    self._recover(exc)
                    if once:  # a one-off run (cron, a deploy step) reports and exits
                        raise
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
                self.wait(poll)
        finally:
            self.close_listener()
            self.close_producer()
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


class PublishFailed(Exception):
    """A publish to the broker failed; the row was held back and the pass ended."""


@contextlib.contextmanager
def running(relay: Relay, *, once: bool = False) -> Iterator[threading.Thread]:
    """Run ``relay`` in a thread for the duration of the block (tests, benchmarks)."""

    def target() -> None:
        try:
            relay.run(once=once)
        finally:
            connections[relay.using].close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        relay.stop()
        thread.join(timeout=30)
