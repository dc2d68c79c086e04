"""Just enough of PostgreSQL's logical replication protocol (``pgoutput``, version 1) to read
a slot as a change data capture tool does: Begin, Relation, Insert and Commit messages.

Read with ``pg_logical_slot_get_binary_changes(slot, NULL, NULL, 'proto_version', '1',
'publication_names', name)``: each row's data is one message. Any other message kind is an
error here, so a test sees what it did not expect (an update, a delete, a truncate).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str
    name: str
    columns: tuple[str, ...]


@dataclass(frozen=True)
class Insert:
    relation: Relation
    # Column name to its text form; None for SQL NULL.
    values: dict[str, str | None]


@dataclass
class Transaction:
    xid: int
    final_lsn: int
    commit_lsn: int = 0
    inserts: list[Insert] = field(default_factory=list)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("!" + fmt, self.data, self.at)
        self.at += struct.calcsize("!" + fmt)
        return value

    def string(self) -> str:
        end = self.data.index(b"\0", self.at)
        text = self.data[self.at : end].decode()
        self.at = end + 1
        return text

    def raw(self, size: int) -> bytes:
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk


def _tuple(reader: _Reader, relation: Relation) -> dict[str, str | None]:
    count = reader.take("h")
    values: dict[str, str | None] = {}
    for name in relation.columns[:count]:
        kind = reader.take("c")
        if kind == b"n":
            values[name] = None
        elif kind == b"t":
            values[name] = reader.raw(reader.take("i")).decode()
        else:
            raise ValueError(f"column {name}: tuple data kind {kind!r} not expected in v1")
    return values


def decode(messages: list[bytes]) -> list[Transaction]:
    """The committed transactions in ``messages``, in the order the slot sent them."""
    relations: dict[int, Relation] = {}
    done: list[Transaction] = []
    current: Transaction | None = None
    for message in messages:
        reader = _Reader(bytes(message))
        kind = reader.take("c")
        if kind == b"B":
            final_lsn, _timestamp, xid = reader.take("q"), reader.take("q"), reader.take("I")
            current = Transaction(xid=xid, final_lsn=final_lsn)
        elif kind == b"R":
            oid, namespace, name = reader.take("I"), reader.string(), reader.string()
            reader.take("c")  # replica identity
            columns = []
            for _ in range(reader.take("h")):
                reader.take("c")  # flags: part of the key
                columns.append(reader.string())
                reader.take("I")  # type oid
                reader.take("i")  # type modifier
            relations[oid] = Relation(oid, namespace, name, tuple(columns))
        elif kind == b"I":
            relation = relations[reader.take("I")]
            if reader.take("c") != b"N":
                raise ValueError("an insert without a new tuple")
            assert current is not None, "an insert outside a transaction"
            current.inserts.append(Insert(relation, _tuple(reader, relation)))
        elif kind == b"C":
            reader.take("c")  # flags
            commit_lsn = reader.take("q")
            assert current is not None, "a commit outside a transaction"
            current.commit_lsn = commit_lsn
            done.append(current)
            current = None
        elif kind in (b"O", b"Y"):
            continue  # origin, type: nothing a test asserts on
        else:
            raise ValueError(f"pgoutput message {kind!r} not expected: {bytes(message)[:40]!r}")
    assert current is None, "the last transaction did not commit"
    return done
