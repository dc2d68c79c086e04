"""What a unit of work claims (``Work``), what ``open()`` decides (``Run``, ``Replay``,
``Refuse``) and what the work produced (``Result``), with no transport in them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, ClassVar

from django_idempotency.engine.errors import REPLAYED, WON, IdempotencyError
from django_idempotency.engine.fingerprints import keyed_parts, plain_parts
from django_idempotency.storage import bodies, records
from django_idempotency.storage.digests import is_keyed

# The order in which differing parts of a fingerprint are reported.
PARTS = ("method", "path", "query", "body")


@dataclass(frozen=True, slots=True)
class Work:
    """What a unit of work claims: whose key, which key, and what was asked."""

    principal: str
    key: str
    method: str
    path: str
    fingerprint: dict[str, str]
    ttl: timedelta
    # The version of the responses the work makes: a record of another is never replayed
    # and, unless ``rerun_other_versions``, the same request on it is refused (410).
    version: str | None = None
    rerun_other_versions: bool = False

    # What each fingerprint part digests (``engine.fingerprints``): the unit keys them into
    # ``fingerprint`` when it opens (where it reads the database's secret anyway), and
    # digests them plain only to compare with a record stored before keyed digests.
    messages: Mapping[str, bytes] | None = field(default=None, compare=False, repr=False)

    def keyed(self, using: str) -> Work:
        """This work with its fingerprint keyed for the records' database ``using``."""
        if self.messages is None or self.fingerprint:
            return self
        return replace(self, fingerprint=keyed_parts(using, self.messages))

    def plain_fingerprint(self) -> dict[str, str]:
        """The fingerprint as plain SHA-256 digests, as records stored before keyed digests
        hold it (and downstream keys derive from, so they stay those of before)."""
        return self.fingerprint if self.messages is None else plain_parts(self.messages)

    def differing(self, stored: dict[str, str]) -> list[str]:
        """The parts of a stored fingerprint that differ from this work's."""
        keyed = not stored or all(is_keyed(value) for value in stored.values())
        return differing(stored, self.fingerprint if keyed else self.plain_fingerprint())


@dataclass(frozen=True, slots=True)
class Result:
    """What the work produced, to store and replay."""

    status: int
    headers: list[list[str]]
    body: bytes


@dataclass(frozen=True, slots=True)
class Run:
    """The key is claimed: run the work, then ``close()``."""

    outcome: ClassVar[str] = WON


@dataclass(frozen=True, slots=True)
class Replay:
    """A stored result for the same work: answer with it; the work does not run.
    ``body`` is as stored: compressed as ``encoding`` says ("", zlib or zstd)."""

    status: int
    headers: list[list[str]]
    body: bytes
    encoding: str
    outcome: ClassVar[str] = REPLAYED

    @classmethod
    def of(cls, record: records.Record) -> Replay:
        return cls(
            record.response_code,
            record.response_headers,
            record.response_body,
            record.body_encoding,
        )

    @property
    def content_coding(self) -> str | None:
        """The HTTP content coding ``body`` is in as stored ("deflate", "zstd"), if any."""
        return bodies.CONTENT_CODINGS.get(self.encoding)

    def sent_body(self) -> bytes:
        """The body as it was first sent."""
        return bodies.decode_body(self.body, self.encoding)


@dataclass(frozen=True, slots=True)
class Refuse:
    """The key cannot be used now (or ever, for this work): answer with the error."""

    error: IdempotencyError

    @property
    def outcome(self) -> str:
        return self.error.outcome


Decision = Run | Replay | Refuse


def differing(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    """The parts of two fingerprints that differ, in ``PARTS`` order, then by name."""
    names = [*PARTS, *sorted((set(stored) | set(current)) - set(PARTS))]
    return [name for name in names if stored.get(name) != current.get(name)]


def view_name(sender: Any) -> str:
    """``module.qualname`` of a view (function or class), an operation's function or a task
    class: how logs and telemetry name who runs the work."""
    module = getattr(sender, "__module__", None) or ""
    name = getattr(sender, "__qualname__", None) or type(sender).__qualname__
    return f"{module}.{name}" if module else name
