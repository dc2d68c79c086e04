"""What one app server sees of its deployment, each fact marked against the contract."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from django.core import checks
from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from django_idempotency.conf import conf
from django_idempotency.engine.hashing import current_secret, keyed_digest, secret_mismatch
from django_idempotency.messaging.outbox import leases
from django_idempotency.partitions import catalog
from django_idempotency.partitions.tables import RECORDS

Verdict = Literal["pass", "fail", "warn", "info"]

SERVER = f"{socket.gethostname()}:{os.getpid()}"
# The claim refuses anything else (contract section 4: REPEATABLE READ would let two servers
# both miss a committed claim).
ISOLATION = "read committed"
# An app clock this far from the database's: records expire by the database's clock, but
# webhook signatures, logs and the probe's own reading of them use the app's.
MAX_SKEW = timedelta(seconds=1)
# Partitions must hold at least the next day, or writes fail (503) when the day turns.
MIN_AHEAD = timedelta(days=1)


@dataclass(frozen=True)
class Fact:
    name: str
    verdict: Verdict
    value: str
    detail: str = ""


def server_facts(using: str) -> list[Fact]:
    """This server's facts about the records' database ``using``."""
    connection = connections[using]
    facts = [Fact("server", "info", SERVER), _secret(using)]
    try:
        facts += [_isolation(connection), _clock(connection)]
        if connection.vendor == "postgresql":
            facts += [_pooler(connection), replication(connection), _partitions(connection)]
        facts.append(_outbox(using))
    except DatabaseError as exc:
        facts.append(Fact("database", "fail", "unreachable", str(exc).strip()))
    return facts + _checks(using)


def secret_fingerprint(using: str) -> str:
    """A digest that is equal on two servers iff they declare one secret: the database's,
    or the ``IDEMPOTENCY_SECRET_KEY`` they are set with (refused unless it is the same)."""
    declared = conf.SECRET_KEY or current_secret(using)
    return keyed_digest(declared, "probe", "secret").hex()[:16]


def _secret(using: str) -> Fact:
    fingerprint = secret_fingerprint(using)
    mismatch = secret_mismatch(using)
    if mismatch is not None:
        return Fact("lock secret", "fail", fingerprint, mismatch)
    return Fact(
        "lock secret",
        "info",
        fingerprint,
        "IDEMPOTENCY_SECRET_KEY, the database's secret"
        if conf.SECRET_KEY
        else "the database's shared secret",
    )


def _isolation(connection: BaseDatabaseWrapper) -> Fact:
    if connection.vendor != "postgresql":
        return Fact("isolation", "info", connection.vendor, "one writer at a time")
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('transaction_isolation')")
        (level,) = cursor.fetchone()
    if level == ISOLATION:
        return Fact("isolation", "pass", level)
    return Fact(
        "isolation",
        "fail",
        level,
        "the claim refuses it (500 misconfigured): set the database's, the role's or "
        "OPTIONS' isolation level to READ COMMITTED",
    )


def _clock(connection: BaseDatabaseWrapper) -> Fact:
    before = time.time()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CAST(strftime('%s', 'now') AS REAL)"
            if connection.vendor == "sqlite"
            else "SELECT extract(epoch FROM clock_timestamp())"
        )
        (database,) = cursor.fetchone()
    after = time.time()
    skew = float(database) - (before + after) / 2
    value = f"{skew * 1000:+.0f} ms"
    if connection.vendor == "sqlite" or abs(skew) <= MAX_SKEW.total_seconds():
        return Fact("clock skew against the database", "pass", value)
    return Fact(
        "clock skew against the database",
        "fail",
        value,
        f"more than {MAX_SKEW.total_seconds():g} s: synchronise the app server's clock (NTP)",
    )


def _pooler(connection: BaseDatabaseWrapper) -> Fact:
    """Whether consecutive transactions of one session run on different server connections.

    Two sessions each hold a transaction, the other one ends last, then the first begins
    again: a transaction pooler (PgBouncer hands out the server connection freed last) gives
    it the other's server connection; a session pooler or a direct connection never does.
    """
    if connection.in_atomic_block:  # ATOMIC_REQUESTS on the report, or a test's transaction
        return Fact("pooler", "info", "not measured", "inside a transaction")
    other = connection.copy()
    try:
        first = _begin(connection)
        _begin(other)
        _end(connection)
        _end(other)
        again = _begin(connection)
        _end(connection)
    finally:
        other.close()
    configured = str(connection.settings_dict.get("PORT") or "5432")
    cursors_off = connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS", False)
    if again[0] != first[0]:
        mode = "transaction pooling (a session's transactions ran on two server connections)"
        if not cursors_off:
            return Fact(
                "pooler",
                "fail",
                mode,
                f"set DISABLE_SERVER_SIDE_CURSORS = True for database {connection.alias!r}: "
                "a cursor would outlive its transaction's server connection",
            )
        return Fact("pooler", "pass", mode, "server-side cursors off")
    port = first[1]
    if port is not None and str(port) != configured:
        return Fact("pooler", "pass", f"a proxy (port {configured} to {port})", "one session")
    return Fact("pooler", "pass", "none seen", "one server connection per session")


# synchronous_commit levels at which a commit is answered only once a synchronous standby
# has it: applied (remote_apply), flushed to its disk (on), or written to its OS and not yet
# flushed (remote_write: lost only if the standby's OS crashes too, with the primary's).
WAITS_FOR_STANDBY = ("on", "remote_apply", "remote_write")
REPLICATION_QUERY = """
SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit'),
       (SELECT count(*) FROM pg_stat_replication),
       (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')),
       (SELECT count(sync_state) FROM pg_stat_replication)
"""


def replication(connection: BaseDatabaseWrapper) -> Fact:
    """Whether the records' database replicates to its standbys synchronously, as its
    ``pg_stat_replication`` and settings (this session's ``synchronous_commit``) say, and what
    a failover to one of them would do to a key (docs/deployment.md, "Failover")."""
    with connection.cursor() as cursor:
        cursor.execute(REPLICATION_QUERY)
        names, commit, standbys, synchronous, visible = cursor.fetchone()
    if standbys and not visible:
        return Fact(
            "replication",
            "info",
            f"{standbys} standbys, their state hidden from this role",
            "grant the role pg_monitor (or pg_read_all_stats) for the probe to see whether "
            "they are synchronous",
        )
    if not standbys and not names:
        return Fact(
            "replication",
            "info",
            "no streaming standby",
            "none replicates from this database; a failover to a copy made another way "
            "(a cloud's storage replication) is not seen here",
        )
    if names and commit in WAITS_FOR_STANDBY and synchronous:
        kept = (
            "a promoted synchronous standby has every commit that was answered: no key runs twice"
        )
        if commit == "remote_write":
            kept = (
                "a commit is answered once the standby wrote it to its OS, before its flush: "
                "a promoted standby has every commit that was answered unless its OS crashed "
                "with the primary's; synchronous_commit on flushes it first"
            )
        return Fact(
            "replication",
            "pass",
            f"synchronous ({synchronous} of {standbys} standbys, synchronous_commit {commit})",
            kept,
        )
    if names and commit in WAITS_FOR_STANDBY:
        return Fact(
            "replication",
            "warn",
            f"synchronous_standby_names is {names!r}, and no synchronous standby is connected",
            "every commit waits until one connects: requests hang, then time out",
        )
    return Fact(
        "replication",
        "warn",
        f"asynchronous ({standbys} standbys, synchronous_commit {commit})",
        "a failover can lose the last commits that were answered: their keys run again on "
        "the new primary, sending the same message ids and downstream keys; name a "
        "synchronous standby (synchronous_standby_names) to lose none",
    )


def _begin(connection: BaseDatabaseWrapper) -> tuple[int, int | None]:
    # Statements of their own, not Django's atomic(): the other session is no alias.
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute("SELECT pg_backend_pid(), inet_server_port()")
        pid, port = cursor.fetchone()
    return pid, port


def _end(connection: BaseDatabaseWrapper) -> None:
    with connection.cursor() as cursor:
        cursor.execute("COMMIT")


def _partitions(connection: BaseDatabaseWrapper) -> Fact:
    now = catalog.database_now(connection)
    found = catalog.list_partitions(connection, RECORDS)
    if not any(p.live for p in found):
        return Fact("partitions ahead", "info", "not partitioned", "a plain table")
    ahead = catalog.covered_until(found, now) - now
    value = f"{ahead.total_seconds() / 86400:.1f} days"
    if ahead >= MIN_AHEAD:
        return Fact("partitions ahead", "pass", value)
    return Fact(
        "partitions ahead",
        "fail",
        value,
        "writes fail (503) when the day turns: schedule partition maintenance "
        "(manage.py idempotency_partitions)",
    )


def _outbox(using: str) -> Fact:
    # Dead letters are no backlog (W121 among the checks below reports them).
    oldest = leases.oldest_pending(using)
    if oldest is None:
        return Fact("outbox backlog", "pass", "empty")
    age = timezone.now() - oldest
    value = f"oldest unpublished message {age.total_seconds():.0f} s old"
    if age <= conf.OUTBOX_MAX_AGE:
        return Fact("outbox backlog", "pass", value)
    return Fact(
        "outbox backlog",
        "fail",
        value,
        "older than IDEMPOTENCY_OUTBOX_MAX_AGE: is a relay running (manage.py idempotency_relay)?",
    )


def _checks(using: str) -> list[Fact]:
    found = checks.run_checks(include_deployment_checks=True, databases=[using])
    ours = [m for m in found if (m.id or "").startswith("django_idempotency.")]
    if not ours:
        return [Fact("system checks", "pass", "none raised")]
    return [
        Fact(
            f"system check {m.id}",
            "fail" if m.level >= checks.ERROR else "warn",
            m.msg,
            m.hint or "",
        )
        for m in ours
        if m.level >= checks.WARNING
    ] or [Fact("system checks", "pass", "none raised")]
