"""The outbox rows' SQL: claim a batch under a fence and a lease, mark it published, fail
(with backoff) or release a row, the redrive's checks, the oldest unpublished row.

Over 400 lines as one concern: every statement on the outbox table in one place, each in its
PostgreSQL and its portable form."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.db import connections, transaction
from django.db.models import Case, DateTimeField, Exists, F, Min, OuterRef, Q, QuerySet, Value, When
from django.db.models.functions import Now
from django.utils import timezone

from django_idempotency.conf import conf
from django_idempotency.messaging.outbox import CHANNEL, TABLE
from django_idempotency.models import OutboxMessage

FENCE_SEQUENCE = "django_idempotency_outbox_fence"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A row whose publish failed waits 1, 2, 4 ... seconds, at most this long, before the next try.
MAX_BACKOFF = timedelta(minutes=5)
# Each redrive doubles the wait before the next check, up to 2**6 times the first.
MAX_DOUBLINGS = 6

# A lease and a mark are bookkeeping the relay survives losing: a crash or a failover that
# loses one publishes those rows again under the same ids, as a relay that dies between
# publish and mark does, and consumers drop the repeat. So their commits do not wait for the
# WAL's flush (nor a synchronous standby). LOCAL: the request transactions of a pooled
# server connection (PgBouncer) keep the server's setting.
UNFLUSHED = "set_config('synchronous_commit', 'off', true)"
# The claim and the mark are one statement each, run in autocommit: a round trip, where a
# transaction around them took three (BEGIN, the statement, COMMIT). It counts beside a
# destination that publishes in the background, whose thread the relay's waits for the GIL
# after each round trip. Inside a caller's transaction they commit with it, as before.

CLAIM = f"""
WITH batch AS (
    SELECT id, created_at FROM {TABLE} AS pending
     WHERE published_at IS NULL AND dead_at IS NULL
       AND (lease_until IS NULL OR lease_until < now())
       -- A keyed message goes only once every earlier one of its key is published: one of
       -- a key per claim, whichever relay claims. An earlier one is committed whenever this
       -- one is (places follow commit order), so no snapshot misses it. A row without a key
       -- stops at the first test.
       AND (pending.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {TABLE} AS earlier
             WHERE earlier.ordering_key = pending.ordering_key
               AND earlier.ordering_seq < pending.ordering_seq
               AND earlier.published_at IS NULL))
     -- The id breaks ties of one millisecond, so that a batch boundary never takes a later
     -- message of that millisecond before an earlier one.
     ORDER BY created_at, id
     LIMIT %s
       FOR UPDATE SKIP LOCKED
), next_fence AS (
    SELECT nextval('{FENCE_SEQUENCE}') AS value
), durability AS (
    SELECT {UNFLUSHED}
), claimed AS (
    -- The batch's ids find its rows by the primary key: joined on the batch alone, the
    -- planner hashed every row of the partition, published ones too. (Not its span as
    -- well: pruning partitions by a subquery's value in an UPDATE crashed a PostgreSQL
    -- 16.14 backend once.)
    UPDATE {TABLE} AS o
       SET lease_owner = %s, lease_until = now() + %s, fence = next_fence.value
      FROM batch, next_fence, durability
     WHERE o.id = batch.id AND o.created_at = batch.created_at
       AND o.id = ANY(ARRAY(SELECT id FROM batch))
    RETURNING o.id, o.created_at, o.kind, o.name, o.args, o.kwargs, o.payload, o.options, o.fence,
              o.redrives, o.ordering_key
)
-- The batch as one JSON document, one array a row in Message's order, decoded by one call:
-- a row's columns and documents loaded one by one cost the relay's thread twice the CPU.
-- In the order written (UPDATE ... RETURNING has none; ids are time-ordered, compared as
-- uuids, not as the text returned); created_at in microseconds, exact. The fence is the
-- same on every row; no row: no fence, no document.
SELECT max(fence),
       json_agg(json_build_array(id, (extract(epoch FROM created_at) * 1000000)::bigint, kind,
                                 name, args, kwargs, payload, options, redrives, ordering_key)
                ORDER BY claimed.created_at, claimed.id)::text
  FROM claimed
"""

# Ids as one comma-separated string: a list of them, quoted one by one on the client, cost the
# relay's thread more than the statement's other work.
IDS = "string_to_array(%s, ',')::uuid[]"

# When the redrive checks a published row's consumer record: after the message's countdown,
# if any, and doubled with each redrive. Parameters: the ids to check, the first wait.
CHECK_AT_SQL = f"""CASE WHEN id = ANY({IDS}) THEN
           greatest(now(), created_at + coalesce((options->>'countdown')::float8, 0)
                           * interval '1 second')
           + %s * power(2, least(redrives, {MAX_DOUBLINGS})) END"""

# created_at bounds prune the statement to the batch's partitions.
MARK = f"""
UPDATE {TABLE} SET published_at = now(), lease_until = NULL, redrive_at = {CHECK_AT_SQL}
  FROM (SELECT {UNFLUSHED}) AS durability
 WHERE id = ANY({IDS}) AND created_at BETWEEN %s AND %s
   AND lease_owner = %s AND fence = %s AND lease_until > now() AND published_at IS NULL
"""

# A failure that was the message's fault (held back) and its last allowed try makes it a
# dead letter. Parameters: error, hold, max backoff, hold, max attempts, the row and lease.
FAIL = f"""
UPDATE {TABLE}
   SET attempts = attempts + 1, last_error = %s, lease_owner = '',
       lease_until = CASE WHEN %s
           THEN now() + interval '1 second' * least(power(2, least(attempts, 20)), %s) END,
       dead_at = CASE WHEN %s AND attempts + 1 >= %s THEN now() END
 WHERE id = %s AND created_at = %s AND lease_owner = %s AND fence = %s
RETURNING dead_at IS NOT NULL
"""

RELEASE = f"""
UPDATE {TABLE} SET lease_owner = '', lease_until = NULL
 WHERE id = ANY({IDS}) AND created_at BETWEEN %s AND %s AND lease_owner = %s
   AND fence = %s AND published_at IS NULL
"""


class Message(NamedTuple):
    """A claimed outbox row, as the relay publishes it. A tuple: built four times faster than
    a frozen dataclass, for every row of every batch."""

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
    # Published only after every earlier message with this key (None: no order kept).
    ordering_key: str | None = None


@dataclass(frozen=True)
class Batch:
    """Rows leased by one claim, all under the same fence."""

    fence: int
    messages: tuple[Message, ...]
    # When the claim returned (time.monotonic()): its lease runs from about then.
    claimed_at: float = field(default_factory=time.monotonic, compare=False)

    def bounds(self, messages: tuple[Message, ...] | None = None) -> list[Any]:
        chosen = self.messages if messages is None else messages
        return [
            ",".join(m.id for m in chosen),
            min(m.created_at for m in chosen),
            max(m.created_at for m in chosen),
        ]


def check_at(message: Message, now: datetime, after: timedelta) -> datetime:
    """CHECK_AT_SQL, in Python (databases other than PostgreSQL)."""
    countdown = message.options.get("countdown") or 0
    start = max(now, message.created_at + timedelta(seconds=countdown))
    return start + after * (1 << min(message.redrives, MAX_DOUBLINGS))


def _postgresql(using: str) -> bool:
    return connections[using].vendor == "postgresql"


def claim(using: str, *, owner: str, limit: int) -> Batch:
    """Lease up to ``limit`` unpublished rows to ``owner``, oldest first, and commit the lease."""
    if not _postgresql(using):
        with transaction.atomic(using=using):
            return _claim_portable(using, owner, limit)
    with connections[using].cursor() as cursor:
        lease: Any = conf.OUTBOX_LEASE  # psycopg sends a timedelta as an interval
        # One statement, its own transaction in autocommit: one round trip (see above CLAIM).
        cursor.execute(CLAIM, [limit, owner, lease])
        fence, document = cursor.fetchone()
    if fence is None:
        return Batch(0, ())
    messages = tuple(
        Message(r[0], EPOCH + timedelta(microseconds=r[1]), *r[2:]) for r in json.loads(document)
    )
    return Batch(int(fence), messages)


def _claim_portable(using: str, owner: str, limit: int) -> Batch:
    # Without SKIP LOCKED and sequences (SQLite, a development fallback): the database
    # serialises writers, and a fence above every claimed row's still moves every row on.
    now = timezone.now()
    earlier = OutboxMessage.objects.using(using).filter(
        ordering_key=OuterRef("ordering_key"),
        ordering_seq__lt=OuterRef("ordering_seq"),
        published_at__isnull=True,
    )
    pending = OutboxMessage.objects.using(using).filter(
        Q(lease_until__isnull=True) | Q(lease_until__lt=now),
        Q(ordering_key__isnull=True) | ~Exists(earlier),
        published_at__isnull=True,
        dead_at__isnull=True,
    )
    rows = list(pending.order_by("created_at", "id")[:limit])
    if not rows:
        return Batch(0, ())
    fence = max(r.fence for r in rows) + 1
    OutboxMessage.objects.using(using).filter(pk__in=[r.pk for r in rows]).update(
        lease_owner=owner, lease_until=now + conf.OUTBOX_LEASE, fence=fence
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
                r.ordering_key,
            )
            for r in rows
        ),
    )


def mark(
    using: str,
    batch: Batch,
    messages: tuple[Message, ...],
    *,
    owner: str,
    check: Collection[str],
    after: timedelta,
) -> int:
    """Mark published the rows ``owner`` still holds under the batch's fence; those in
    ``check`` get their redrive check time (``after`` the publish, or the countdown). Return
    how many were marked."""
    if not messages:
        return 0
    if _postgresql(using):
        params: list[Any] = [",".join(check), after, *batch.bounds(messages)]
        with connections[using].cursor() as cursor:
            cursor.execute(MARK, [*params, owner, batch.fence])  # its own transaction
            return int(cursor.rowcount)
    with transaction.atomic(using=using):
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
            OutboxMessage.objects.using(using)
            .filter(
                pk__in=list(ids.values()),
                lease_owner=owner,
                fence=batch.fence,
                lease_until__gt=now,
                published_at__isnull=True,
            )
            .update(published_at=now, lease_until=None, redrive_at=redrive_at)
        )


def fail(using: str, batch: Batch, message: Message, error: str, *, owner: str, hold: bool) -> bool:
    """Count a failed publish and give the row back; with ``hold`` (the message's own fault),
    not before a backoff, and as a dead letter once it has had IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS
    tries. Return whether it is now a dead letter."""
    limit = conf.OUTBOX_MAX_ATTEMPTS
    with transaction.atomic(using=using):
        if _postgresql(using):
            with connections[using].cursor() as cursor:
                cursor.execute(
                    FAIL,
                    [
                        error[:2000],
                        hold,
                        MAX_BACKOFF.total_seconds(),
                        hold,
                        limit,
                        uuid.UUID(message.id),
                        message.created_at,
                        owner,
                        batch.fence,
                    ],
                )
                found = cursor.fetchone()
            return bool(found and found[0])
        row = OutboxMessage.objects.using(using).filter(
            pk=uuid.UUID(message.id), lease_owner=owner, fence=batch.fence
        )
        for current in row:
            delay = min(timedelta(seconds=2 ** min(current.attempts, 20)), MAX_BACKOFF)
            dead = hold and current.attempts + 1 >= limit
            row.update(
                attempts=current.attempts + 1,
                last_error=error[:2000],
                lease_owner="",
                lease_until=timezone.now() + delay if hold else None,
                dead_at=timezone.now() if dead else None,
            )
            return dead
        return False


def release(using: str, batch: Batch, messages: tuple[Message, ...], *, owner: str) -> None:
    """Give rows back untried, for the next pass of any relay."""
    if not messages:
        return
    with transaction.atomic(using=using):
        if _postgresql(using):
            with connections[using].cursor() as cursor:
                cursor.execute(RELEASE, [*batch.bounds(messages), owner, batch.fence])
            return
        OutboxMessage.objects.using(using).filter(
            pk__in=[uuid.UUID(m.id) for m in messages],
            lease_owner=owner,
            fence=batch.fence,
            published_at__isnull=True,
        ).update(lease_owner="", lease_until=None)


def due_for_check(using: str, limit: int) -> list[OutboxMessage]:
    """Lock up to ``limit`` published rows whose redrive check is due, oldest check first,
    skipping those another relay holds; inside the caller's transaction."""
    return list(
        OutboxMessage.objects.using(using)
        .select_for_update(skip_locked=True)
        .filter(redrive_at__lte=Now())
        .order_by("redrive_at")
        .only("id", "created_at", "kind", "name", "options", "redrives")[:limit]
    )


def checked(using: str, ids: Collection[Any], *, error: str = "") -> None:
    """No more checks for these rows; ``error``, if any, says why in their ``last_error``."""
    found = OutboxMessage.objects.using(using).filter(pk__in=ids)
    found.update(redrive_at=None, **({"last_error": error} if error else {}))


def bury(using: str, ids: Collection[Any], *, error: str) -> None:
    """Make published rows whose exactly-once consumer never recorded them dead letters:
    unpublished again, so kept, counted and listed as every dead letter is, and never tried
    until an operator requeues them."""
    OutboxMessage.objects.using(using).filter(pk__in=ids).update(
        published_at=None,
        redrive_at=None,
        dead_at=Now(),
        lease_owner="",
        lease_until=None,
        last_error=error,
    )


def publish_again(using: str, ids: Collection[Any], *, error: str) -> None:
    """Put published rows back to be published under the same ids, and wake the relays."""
    OutboxMessage.objects.using(using).filter(pk__in=ids).update(
        published_at=None,
        redrive_at=None,
        lease_owner="",
        lease_until=None,
        redrives=F("redrives") + 1,
        last_error=error,
    )
    connection = connections[using]
    if connection.vendor == "postgresql" and conf.OUTBOX_NOTIFY:
        # Delivered on commit: every relay wakes to publish it.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [CHANNEL])


def requeue(using: str, ids: Collection[str] | None = None) -> int:
    """Give dead letters (those of ``ids``, or all) their tries back, to be published again
    under the same ids; wake the relays. Return how many."""
    with transaction.atomic(using=using):
        dead = OutboxMessage.objects.using(using).filter(dead_at__isnull=False)
        if ids is not None:
            dead = dead.filter(pk__in=[uuid.UUID(str(i)) for i in ids])
        # Its redrives too: a consumer that failed for good gets its checks back.
        count = dead.update(dead_at=None, attempts=0, redrives=0, lease_owner="", lease_until=None)
        connection = connections[using]
        if count and connection.vendor == "postgresql" and conf.OUTBOX_NOTIFY:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, '')", [CHANNEL])
    return count


# The three questions operators ask of the outbox, each answered here only: the relay, the
# gauges, the checks (W120, W121), `idempotency_outbox status` and the probe all call these.
# The one rule: a dead letter is no part of the backlog (it waits for an operator, not for a
# relay), so it never ages the backlog; it is counted apart, by dead_letters().


def _pending(using: str) -> QuerySet[OutboxMessage]:
    return OutboxMessage.objects.using(using).filter(
        published_at__isnull=True, dead_at__isnull=True
    )


def backlog(using: str, limit: int) -> int:
    """How many unpublished messages wait to be tried, counted up to ``limit`` (a count stays
    cheap however far behind the relay is); dead letters are not among them."""
    return _pending(using).values("pk")[:limit].count()


def dead_letters(using: str, limit: int) -> int:
    """How many dead letters the outbox holds, counted up to ``limit``."""
    found = OutboxMessage.objects.using(using).filter(dead_at__isnull=False)
    return found.values("pk")[:limit].count()


def oldest_pending(using: str) -> datetime | None:
    """When the oldest unpublished message still to be tried was written; None when there is
    none (dead letters wait for an operator, and are counted apart)."""
    oldest: datetime | None = _pending(using).aggregate(oldest=Min("created_at"))["oldest"]
    return oldest
