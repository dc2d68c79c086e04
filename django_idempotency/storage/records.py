"""Every query on the records table, the only writer of new records: claim, lookup, store (the
migrations' functions on PostgreSQL, a unique index elsewhere), the redrive's check, a delete.

Over 400 lines as one concern: the table's every statement in one place, so that no other
module writes SQL on it."""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from django.db import DatabaseError, IntegrityError, connections, transaction
from django.utils import timezone

from django_idempotency.db import sqlstate
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import cursors
from django_idempotency.storage.bodies import decode_body
from django_idempotency.storage.erasure import tombstone_scope

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

# SQLSTATE of "no partition of relation ... found for row": maintenance has not run.
NO_PARTITION_SQLSTATE = "23514"
# SQLSTATE the claim raises at REPEATABLE READ or SERIALIZABLE (migrations/0001_initial.py).
ISOLATION_REFUSED_SQLSTATE = "0AI01"


class Outcome(enum.Enum):
    """What a claim found."""

    WON = "won"  # the key is ours until the transaction ends
    FOUND = "found"  # a stored response to replay
    # A stored response past its lifetime, within the 410 window; of another version where
    # a window is configured; erased (a tombstone) until it would have expired.
    EXPIRED = "expired"
    # A record of another version than the work's (``record``); ``created_at``: the claim's
    # now, for the work's record if the key runs anew (``reclaim``). The claim holds the key.
    STALE = "stale"
    BUSY = "busy"  # another transaction holds the key, and the wait ran out


class IsolationRefused(Exception):
    """The claim refused to run: the transaction's isolation level (``level``) takes its
    snapshot before the key's lock, so it could not see a record committed meanwhile."""

    def __init__(self, using: str, level: str) -> None:
        super().__init__(f"database {using!r} runs the claim at isolation level {level}")
        self.using = using
        self.level = level


@dataclass(frozen=True, slots=True)
class Record:
    """A finished record, as a claim or a lookup found it."""

    created_at: datetime
    expires_at: datetime
    method: str
    path: str
    fingerprint: dict[str, str]
    response_code: int
    response_headers: list[list[str]]
    response_body: bytes
    body_encoding: str

    def body(self) -> bytes:
        """The response body as it was sent."""
        return decode_body(self.response_body, self.body_encoding)


@dataclass(frozen=True, slots=True)
class Claimed:
    outcome: Outcome
    # When the claim was made (WON): the record's created_at, so it lands in the
    # partition that was checked for at claim time.
    created_at: datetime | None = None
    record: Record | None = None
    # Other databases only: the in-progress row that the claim inserted.
    row_id: int | None = None
    # WON, STALE: the generation of the execution that starts.
    generation: int = 0


class ClaimRow(NamedTuple):
    """A row of ``django_idempotency_claim()``, in the order of its OUT columns."""

    outcome: str
    created_at: datetime | None
    expires_at: datetime | None
    method: str | None
    path: str | None
    fingerprint: Any
    response_code: int | None
    response_headers: Any
    response_body: bytes | memoryview | None
    body_encoding: str | None
    # The claim's only (the lookup has no such column).
    generation: int | None = None

    def record(self) -> Record:
        assert self.expires_at is not None and self.created_at is not None
        return Record(
            created_at=self.created_at,
            expires_at=self.expires_at,
            method=self.method or "",
            path=self.path or "",
            fingerprint=_jsonb(self.fingerprint),
            response_code=self.response_code or 200,
            response_headers=_jsonb(self.response_headers) or [],
            response_body=bytes(self.response_body or b""),
            body_encoding=self.body_encoding or "",
        )


def _jsonb(value: Any) -> Any:
    # psycopg hands jsonb back decoded; other drivers may give text.
    return json.loads(value) if isinstance(value, str) else value


# The last parameters: the version (null: none), and the principal of the key's tombstone.
_CLAIM = "SELECT * FROM django_idempotency_claim(%s, %s, %s, %s, %s, %s, %s, %s, %s)"
_LOCK_ALL = "SELECT django_idempotency_lock_all(%s::integer[], %s)"


def claim(
    using: str,
    *,
    lock: int,
    principal: str,
    key: str,
    window: timedelta,
    gone: timedelta,
    wait: timedelta,
    now: datetime | None = None,
    also_lock: Sequence[int] = (),
    version: str | None = None,
    opening: bool = False,
) -> Claimed:
    """Claim (principal, key) inside the caller's transaction, or find the record that
    holds it, waiting up to ``wait`` for an in-flight holder. The claim lasts until that
    transaction ends. ``also_lock``: the key's locks under fallback secrets, taken first.
    A record of another ``version`` than the work's is expired (``gone``) or replaced.
    ``opening``: the claim is expected to win (a lookup found no record): where it opens the
    transaction, its ``BEGIN`` travels with it, and a record it finds after all is read as
    text (a replay's claim reads it in binary, after a ``BEGIN`` of its own)."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return _claim_plain(using, principal, key, gone, now, version)
    wait_ms = max(0, int(wait.total_seconds() * 1000))
    if also_lock:
        # Every lock in one order, the claim's own among them, so that no two claims wait
        # for each other; the claim then re-takes its own at once (advisory locks are
        # re-entrant). A statement more, only while a rotation has fallbacks.
        fetch = cursors.fetch_one_opening if opening else cursors.fetch_one
        locked = fetch(connection, _LOCK_ALL, [sorted({lock, *also_lock}), wait_ms])
        if locked is None or not locked[0]:
            return Claimed(Outcome.BUSY)
    try:
        erased = tombstone_scope(using, principal)
        params = [lock, principal, key, window, gone, wait_ms, now, version, erased]
        row = _call(connection, _CLAIM, params, opening=opening)
    except DatabaseError as exc:
        if sqlstate(exc) == ISOLATION_REFUSED_SQLSTATE:
            raise IsolationRefused(using, _detail(exc)) from exc
        raise
    assert row is not None  # the claim answers every call with one row
    outcome = Outcome(row.outcome)
    if outcome is Outcome.WON:
        return Claimed(outcome, created_at=row.created_at, generation=row.generation or 0)
    if outcome is Outcome.STALE:
        return Claimed(
            outcome,
            created_at=row.created_at,
            record=row.record(),
            generation=row.generation or 0,
        )
    if outcome is Outcome.BUSY:
        return Claimed(outcome)
    return Claimed(outcome, record=row.record())


# The last parameters: the claim's now (null: the database's), the version (null: none), and
# the principal of the key's tombstone (migration 0001_initial).
_LOOKUP = "SELECT * FROM django_idempotency_lookup(%s, %s, %s, %s, %s, %s)"
# psycopg's names of the levels at which the claim refuses to run (migration 0007).
_REFUSED_LEVELS = {"REPEATABLE_READ": "repeatable read", "SERIALIZABLE": "serializable"}


def lookup(
    using: str,
    *,
    principal: str,
    key: str,
    window: timedelta,
    version: str | None = None,
    now: datetime | None = None,
) -> Record | None:
    """The record the claim would answer ``found`` with (of ``version``, live, the key's
    newest, not erased), read without a lock or a transaction of our own: one round trip
    for a replay; None for anything else, which the claim then decides. Raises
    ``IsolationRefused`` where the claim would."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return _lookup_plain(using, principal, key, window, version, now)
    connection.ensure_connection()
    # Outside a transaction the function cannot see the level the claim's BEGIN would set.
    level = getattr(connection.connection.isolation_level, "name", None)
    if level in _REFUSED_LEVELS:
        raise IsolationRefused(using, _REFUSED_LEVELS[level])
    erased = tombstone_scope(using, principal)
    try:
        row = _call(connection, _LOOKUP, [principal, key, window, now, version, erased])
    except DatabaseError as exc:
        if sqlstate(exc) == ISOLATION_REFUSED_SQLSTATE:
            raise IsolationRefused(using, _detail(exc)) from exc
        raise
    return None if row is None else row.record()


def _call(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any], *, opening: bool = False
) -> ClaimRow | None:
    """The row a function of the migrations answers, read in binary (as text where it
    ``opening`` the transaction travels with its BEGIN); None if it has none.
    (psycopg adapts timedelta to interval; django-stubs' parameter types leave it out.)"""
    fetch = cursors.fetch_one_opening if opening else cursors.fetch_one
    row = fetch(connection, sql, params)
    return None if row is None else ClaimRow(*row)


def _lookup_plain(
    using: str,
    principal: str,
    key: str,
    window: timedelta,
    version: str | None,
    now: datetime | None,
) -> Record | None:
    # The newest of what _claim_plain reads, where it would answer FOUND.
    now = now or timezone.now()
    found = (
        IdempotencyRecord.objects.using(using)
        .filter(
            scope__in=(principal, tombstone_scope(using, principal)),
            key=key,
            created_at__gte=now - window,
        )
        .order_by("-created_at", "-pk")
        .first()
    )
    if (
        found is None
        or found.scope != principal
        or found.status != IdempotencyRecord.Status.COMPLETED
        or found.expires_at <= now
        or found.response_version != version
    ):
        return None
    return as_record(found)


def _claim_plain(
    using: str,
    principal: str,
    key: str,
    gone: timedelta,
    now: datetime | None,
    version: str | None,
) -> Claimed:
    """Other databases: the claim inserts an in-progress row; a concurrent claimer loses
    on the unique index; an expired row (or one of another version) is replaced."""
    now = now or timezone.now()
    records = IdempotencyRecord.objects.using(using)
    scopes = (principal, tombstone_scope(using, principal))
    existing = records.filter(scope__in=scopes, key=key).order_by("-created_at", "-pk").first()
    if existing is not None:
        if existing.status == IdempotencyRecord.Status.IN_PROGRESS:
            return Claimed(Outcome.BUSY)
        if existing.expires_at + gone > now:
            live = existing.expires_at > now
            if existing.status == IdempotencyRecord.Status.ERASED or not live:
                return Claimed(Outcome.EXPIRED, record=as_record(existing))
            if existing.response_version != version:
                return Claimed(Outcome.STALE, created_at=now, record=as_record(existing))
            return Claimed(Outcome.FOUND, record=as_record(existing))
        records.filter(scope__in=scopes, key=key).delete()
    try:
        with transaction.atomic(using=using):
            created = records.create(
                scope=principal,
                key=key,
                method="",
                path="",
                fingerprint={},
                created_at=now,
                expires_at=now,
            )
    except IntegrityError:
        return Claimed(Outcome.BUSY)
    return Claimed(Outcome.WON, created_at=now, row_id=created.pk)


def reclaim(using: str, stale: Claimed, *, principal: str, key: str) -> Claimed:
    """The key of a stale claim, won for the work to run anew in the claim's transaction: its
    record is stored beside the stale one (PostgreSQL: the claim reads the newest) or
    replaces it (other databases)."""
    assert stale.outcome is Outcome.STALE and stale.created_at is not None
    if connections[using].vendor == "postgresql":
        return Claimed(Outcome.WON, created_at=stale.created_at, generation=stale.generation)
    IdempotencyRecord.objects.using(using).filter(scope=principal, key=key).delete()
    return _claim_plain(using, principal, key, timedelta(0), stale.created_at, None)


def as_record(obj: IdempotencyRecord) -> Record:
    """A finished record as the ORM read it."""
    return Record(
        created_at=obj.created_at,
        expires_at=obj.expires_at,
        method=obj.method,
        path=obj.path,
        fingerprint=obj.fingerprint,
        response_code=obj.response_code or 200,
        response_headers=obj.response_headers or [],
        response_body=bytes(obj.response_body or b""),
        body_encoding=obj.body_encoding,
    )


# The last two parameters: the version (null: none) and the generation.
_STORE = "SELECT django_idempotency_store(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
# psycopg's commit() sends nothing when the server is already idle, so a COMMIT sent
# with the store saves the transaction's last round trip.
_STORE_AND_COMMIT = _STORE + "; COMMIT"
# SQLSTATE unique_violation, and the suffix of the per-partition index that raises it for a
# second execution of a key (the migration, ``partitions.tables.RECORDS``).
UNIQUE_VIOLATION_SQLSTATE = "23505"
ONE_EXECUTION_INDEX_SUFFIX = "_one_execution"
# Below this, a body's hex literal costs less than psycopg's pipeline, about 0.12 ms of
# Python per store (the crossover measured between 32 and 64 KiB).
BINARY_BODY_MIN_BYTES = 32 * 1024


@dataclass(frozen=True, slots=True)
class Finished:
    """A record to write: the claim's identity and the response."""

    principal: str
    key: str
    method: str
    path: str
    fingerprint: dict[str, str]
    created_at: datetime
    expires_at: datetime
    code: int
    # None when they travel sealed inside the body (storage/sealing.py).
    headers: list[list[str]] | None
    body: bytes
    body_encoding: str
    # The version its view declares (None: none).
    version: str | None = None
    # The claim's (``Claimed.generation``).
    generation: int = 0


def store(
    using: str,
    record: Finished,
    *,
    row_id: int | None,
    commit: bool,
    riders: Sequence[tuple[str, list[Any]]] = (),
) -> None:
    """Write the finished record in the claim's transaction; with ``commit``, commit that
    transaction in the same round trip. ``riders`` (``storage.riders``) go first, in the
    same round trip."""
    connection = connections[using]
    if row_id is not None:
        IdempotencyRecord.objects.using(using).filter(pk=row_id).update(
            method=record.method,
            path=record.path,
            fingerprint=record.fingerprint,
            expires_at=record.expires_at,
            status=IdempotencyRecord.Status.COMPLETED,
            response_code=record.code,
            response_headers=record.headers,
            response_body=record.body,
            body_encoding=record.body_encoding,
            response_version=record.version,
        )
        return
    params: list[Any] = [
        record.principal,
        record.key,
        record.method,
        record.path,
        json.dumps(record.fingerprint),
        record.created_at,
        record.expires_at,
        record.code,
        json.dumps(record.headers),
        record.body,
        record.body_encoding,
        record.version,
        record.generation,
    ]
    store_sql, with_commit = _STORE, _STORE_AND_COMMIT
    if len(record.body) < BINARY_BODY_MIN_BYTES:
        sql = with_commit if commit else store_sql
        if riders:
            # Bound on the client: the statements travel as one string.
            sql = "; ".join([*(statement for statement, _ in riders), sql])
            params = [*(value for _, values in riders for value in values), *params]
        cursors.execute(connection, sql, params)
        return
    from psycopg import Pipeline

    with cursors.binary_cursor(connection) as cursor:
        if not (commit and Pipeline.is_supported()):
            for statement, values in riders:
                cursor.execute(statement, values)
            cursor.execute(store_sql, params)
            return
        # A statement bound on the server travels alone, so the store and its COMMIT share
        # a pipeline: still one round trip. Errors surface when it syncs, hence Django's
        # wrapping around it too.
        with connection.wrap_database_errors, connection.connection.pipeline():
            for statement, values in riders:
                cursor.execute(statement, values)
            cursor.execute(store_sql, params)
            cursor.execute("COMMIT")


def second_execution(exc: BaseException) -> bool:
    """Whether a failed store was refused as a second execution of its key: another
    execution of the same generation committed first (the lock did not serialise them)."""
    cause = exc.__cause__ if isinstance(exc, DatabaseError) else None
    if getattr(cause, "sqlstate", None) != UNIQUE_VIOLATION_SQLSTATE:
        return False
    constraint = getattr(getattr(cause, "diag", None), "constraint_name", None) or ""
    return constraint.endswith(ONE_EXECUTION_INDEX_SUFFIX)


def missing_partition(exc: BaseException) -> bool:
    """Whether a failed store found no partition for its row."""
    cause = exc.__cause__ if isinstance(exc, DatabaseError) else None
    return getattr(cause, "sqlstate", None) == NO_PARTITION_SQLSTATE and "partition" in str(exc)


def _detail(exc: BaseException) -> str:
    diag = getattr(exc.__cause__, "diag", None)
    return str(getattr(diag, "message_detail", None) or "unknown")


def transaction_broken(using: str) -> bool:
    """Whether the current transaction can no longer commit: marked for rollback, or a
    database error that the view caught without a savepoint."""
    if transaction.get_rollback(using=using):
        return True
    connection = connections[using]
    if connection.vendor != "postgresql" or connection.connection is None:
        return False
    from psycopg.pq import TransactionStatus

    return bool(connection.connection.info.transaction_status == TransactionStatus.INERROR)


def recorded(
    using: str, *, principals: Collection[str], keys: Collection[str], since: datetime
) -> set[tuple[str, str]]:
    """The (principal, key) pairs, among those of ``principals`` and ``keys``, that have a
    record made since ``since`` (the bound prunes the query to the partitions from then on).
    An erased record counts: its tombstone still answers the key."""
    erased = {tombstone_scope(using, principal): principal for principal in principals}
    found = IdempotencyRecord.objects.using(using).filter(
        key__in=keys, scope__in=[*principals, *erased], created_at__gte=since
    )
    return {(erased.get(scope, scope), key) for scope, key in found.values_list("scope", "key")}


def delete(using: str | None, *, record_id: int, created_at: datetime) -> None:
    """Delete one record (on ``using``, else the router's database), freeing its key;
    ``created_at`` prunes the delete to the record's partition."""
    IdempotencyRecord.objects.using(using).filter(pk=record_id, created_at=created_at).delete()
