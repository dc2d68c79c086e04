"""What the admin shows of a stored response: all of it to a user with the
``view_stored_response`` permission; to others its status, size and masked headers, never
the body nor anything from which it could be recovered (no digest), except the JSON fields
that ``IDEMPOTENCY_ADMIN_SHOW_FIELDS`` opts in to (with ``IDEMPOTENCY_ADMIN_REDACT_FIELDS``
masked among them)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest
from django.utils.translation import gettext, ngettext

from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import bodies, digests, sealing
from django_idempotency.storage.records import as_record

PERMISSION = "django_idempotency.view_stored_response"
MASK = "[redacted]"
# Stored bodies longer than this are cut in the detail view, which must stay a web page.
BODY_PREVIEW_CHARS = 100_000
# Header values shown without the permission: they describe the response's form, never
# what it is about (a Location, an ETag or a configured header may name an object).
PLAIN_HEADERS = frozenset(
    ("content-type", "content-language", "cache-control", "expires", "pragma", "vary")
)
DIGEST_HEX = 16
# The purpose of the body digest's key (storage/digests.py): shown to readers only.
BODY_DIGEST = "admin-body"
# Words of a JSON key: split on separators and lower-to-upper case changes.
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def may_read(request: HttpRequest) -> bool:
    """Whether the user may read stored bodies and headers (superusers may)."""
    return bool(request.user.has_perm(PERMISSION))


@dataclass(frozen=True, slots=True)
class Shown:
    """A stored response, opened: its headers and body as sent, or why it cannot be."""

    headers: list[list[str]]
    body: bytes
    stored_bytes: int
    unreadable: str = ""

    def digest(self, using: str) -> str:
        """A keyed digest of the body (HMAC, never a plain hash to test guesses against),
        to tell two bodies apart; for users who may read the body anyway."""
        return digests.digest_hex(using, BODY_DIGEST, self.body)[: len(digests.PREFIX) + DIGEST_HEX]


def opened(obj: IdempotencyRecord) -> Shown:
    stored_bytes = len(obj.response_body or b"")
    ring = None
    with contextlib.suppress(sealing.MalformedKeys):  # E015 says so; shown as unreadable
        ring = sealing.keyring(conf.ENCRYPTION_KEYS)
    try:
        record = sealing.opened(as_record(obj), ring, scope=obj.scope, key=obj.key, plain=True)
    except sealing.Unreadable as exc:
        return Shown([], b"", stored_bytes, str(exc))
    try:
        body = bodies.decode_body(record.response_body, record.body_encoding)
    except bodies.ZstdMissing as exc:
        return Shown([], b"", stored_bytes, str(exc))
    return Shown(record.response_headers, body, stored_bytes)


def encoding_label(encoding: str) -> str:
    """How a body is stored, for people."""
    key_id = sealing.sealed_under(encoding)
    if key_id is None:
        return encoding or gettext("as sent")
    label = gettext("sealed with AES-256-GCM under key %(key)s") % {"key": key_id}
    inner = sealing.inner_encoding(encoding)
    if inner:
        label += gettext(", %(codec)s inside") % {"codec": inner}
    return label


def headers_text(headers: Sequence[Sequence[str]], *, full: bool) -> str:
    return "\n".join(
        f"{name}: {value if full or name.lower() in PLAIN_HEADERS else MASK}"
        for name, value in headers
    )


def body_text(body: bytes, *, full: bool) -> str:
    """The body for people: with ``full`` as it is (JSON indented, binary described);
    without, only the fields ``IDEMPOTENCY_ADMIN_SHOW_FIELDS`` lists of a JSON body, with
    ``IDEMPOTENCY_ADMIN_REDACT_FIELDS`` masked among them, and nothing when it lists none."""
    if not full:
        return _fields_text(body)
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return ngettext(
            "%(size)d byte of binary data", "%(size)d bytes of binary data", len(body)
        ) % {"size": len(body)}
    with contextlib.suppress(ValueError):
        text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    return _preview(text)


def _fields_text(body: bytes) -> str:
    hidden = ngettext(
        "Hidden: %(size)d byte, shown only with the permission to view stored responses.",
        "Hidden: %(size)d bytes, shown only with the permission to view stored responses.",
        len(body),
    ) % {"size": len(body)}
    paths = [name.split(".") for name in conf.ADMIN_SHOW_FIELDS]
    if not paths:
        return hidden
    try:
        parsed = json.loads(body)
    except ValueError:  # UnicodeDecodeError is one
        return hidden
    shown = picked(parsed, paths)
    if shown is _NOTHING:
        return hidden
    masked_fields = masked(shown, conf.ADMIN_REDACT_FIELDS)
    return _preview(json.dumps(masked_fields, indent=2, ensure_ascii=False))


def _preview(text: str) -> str:
    if len(text) > BODY_PREVIEW_CHARS:
        return ngettext(
            "%(text)s\n… (%(size)d character in all)",
            "%(text)s\n… (%(size)d characters in all)",
            len(text),
        ) % {
            "text": text[:BODY_PREVIEW_CHARS],
            "size": len(text),
        }
    return text


_NOTHING: Any = object()


def picked(value: Any, paths: Sequence[Sequence[str]]) -> Any:
    """The parts of ``value`` that ``paths`` name (``["card", "brand"]``: the key brand of
    the object card), through lists at any level; ``_NOTHING`` when none is there."""
    if isinstance(value, list):
        items = [picked(item, paths) for item in value]
        kept = [item for item in items if item is not _NOTHING]
        return kept if kept else _NOTHING
    if not isinstance(value, dict):
        return _NOTHING
    found: dict[str, Any] = {}
    for name, item in value.items():
        if any(len(path) == 1 and path[0] == name for path in paths):
            found[name] = item
            continue
        inner = [path[1:] for path in paths if len(path) > 1 and path[0] == name]
        if inner:
            sub = picked(item, inner)
            if sub is not _NOTHING:
                found[name] = sub
    return found if found else _NOTHING


def masked(value: Any, names: Sequence[str]) -> Any:
    """``value`` with the values of listed keys replaced, at any depth."""
    if not names:
        return value
    listed = [_words(name) for name in names]
    return _masked(value, listed)


def _masked(value: Any, listed: list[list[str]]) -> Any:
    if isinstance(value, dict):
        return {
            key: MASK if _listed(key, listed) else _masked(item, listed)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_masked(item, listed) for item in value]
    return value


def _listed(key: str, listed: list[list[str]]) -> bool:
    # "card" masks card, card_number and cardNumber, but "pan" never masks company.
    words = _words(key)
    return any(
        name and words[i : i + len(name)] == name
        for name in listed
        for i in range(len(words) - len(name) + 1)
    )


def _words(name: str) -> list[str]:
    return [word.lower() for word in _WORDS.findall(name)]
