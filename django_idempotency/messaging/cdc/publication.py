"""The event table's PostgreSQL publication: what exists (publication, ``wal_level``, logical
slots and their lag), and the SQL that makes it what change data capture needs."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connections, transaction

from django_idempotency.messaging.cdc import TABLE

# The publication and the event table, in one row (none: no such publication). The table
# counts as published through the root, a partition of it, or FOR ALL TABLES / a schema
# (pg_publication_tables lists those too).
PUBLICATION = """
SELECT p.pubviaroot, p.pubinsert, EXISTS (
    SELECT 1 FROM pg_publication_tables t
    WHERE t.pubname = p.pubname
      AND to_regclass(format('%%I.%%I', t.schemaname, t.tablename)) IN (
          SELECT to_regclass(%s)
          UNION ALL SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = to_regclass(%s)
      )
)
FROM pg_publication p WHERE p.pubname = %s
"""

# Logical slots on this database, and how far behind the server's WAL each has confirmed.
SLOTS = """
SELECT slot_name, plugin, active, confirmed_flush_lsn::text,
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint END
FROM pg_replication_slots
WHERE slot_type = 'logical' AND database = current_database()
ORDER BY slot_name
"""


@dataclass(frozen=True)
class Slot:
    """A logical replication slot: who reads the log (Debezium, for one), and its lag."""

    name: str
    plugin: str
    active: bool
    confirmed_flush_lsn: str | None
    # WAL bytes written since the slot's reader last confirmed; None on a standby.
    lag_bytes: int | None


@dataclass(frozen=True)
class State:
    """What a database has of what change data capture needs."""

    publication: str
    wal_level: str
    exists: bool
    includes_table: bool
    via_root: bool
    publishes_inserts: bool
    slots: tuple[Slot, ...]

    @property
    def decodes(self) -> bool:
        """Whether the server writes a log that logical slots can decode."""
        return self.wal_level == "logical"

    def problems(self) -> list[str]:
        """What keeps the publication from carrying the event table's inserts as one table."""
        if not self.exists:
            return [f"publication {self.publication!r} does not exist"]
        found = []
        if not self.includes_table:
            found.append(f"publication {self.publication!r} does not include {TABLE}")
        if not self.via_root:
            found.append(
                f"publication {self.publication!r} publishes each partition as its own table "
                "(publish_via_partition_root is off)"
            )
        if not self.publishes_inserts:
            found.append(f"publication {self.publication!r} does not publish inserts")
        return found


def state(using: str, publication: str) -> State:
    """The publication named ``publication`` on ``using``, and the logical slots there."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT current_setting('wal_level')")
        (wal_level,) = cursor.fetchone()
        cursor.execute(PUBLICATION, [TABLE, TABLE, publication])
        row = cursor.fetchone()
        cursor.execute(SLOTS)
        slots = tuple(Slot(*slot) for slot in cursor.fetchall())
    via_root, inserts, included = row if row is not None else (False, False, False)
    return State(publication, wal_level, row is not None, included, via_root, inserts, slots)


def statements(using: str, found: State) -> list[str]:
    """The SQL that makes ``found``'s publication publish the event table's inserts through
    its root; none if it does. Inserts a publication does not publish are left for its
    owner: publishing them would change what it publishes for its other tables too."""
    quote = connections[using].ops.quote_name
    name, table = quote(found.publication), quote(TABLE)
    if not found.exists:
        return [
            f"CREATE PUBLICATION {name} FOR TABLE {table} "
            "WITH (publish = 'insert', publish_via_partition_root = true)"
        ]
    needed = []
    if not found.includes_table:
        needed.append(f"ALTER PUBLICATION {name} ADD TABLE {table}")
    if not found.via_root:
        needed.append(f"ALTER PUBLICATION {name} SET (publish_via_partition_root = true)")
    return needed


def apply(using: str, publication: str) -> list[str]:
    """Run ``statements()`` for ``publication`` on ``using`` in one transaction; return them.

    Needs the rights ``CREATE PUBLICATION`` needs: ownership of the event table and
    ``CREATE`` on the database. Raises the database's error without them.
    """
    needed = statements(using, state(using, publication))
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        for statement in needed:
            cursor.execute(statement)
    return needed
