"""What identifies a request: its Idempotency-Key, whose key it is (the principal), and
its fingerprint (method, path, query, canonical body, chosen headers)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from django.http import HttpRequest, QueryDict

from django_idempotency.conf import PrincipalFunc
from django_idempotency.engine.errors import InvalidKey

MAX_KEY_LENGTH = 255
# Printable ASCII without the characters that delimit structured-field lists and
# parameters, so a comma list (or two header lines joined by the server) is never a key.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - set('",;\\')
_OWS = " \t"
ANONYMOUS = "anonymous"


def parse_key(raw: str) -> str:
    """Return the key from a header value: an RFC 8941 string or a bare value."""
    value = raw.strip(_OWS)
    if value.startswith('"'):
        end = value.find('"', 1)
        if end == -1:
            raise InvalidKey("The quoted Idempotency-Key has no closing quote.")
        key, rest = value[1:end], value[end + 1 :].lstrip(_OWS)
        # Parameters are allowed (and ignored); anything else means a list or garbage.
        if rest and (not rest.startswith(";") or "," in rest):
            raise InvalidKey("The Idempotency-Key must be a single value.")
    else:
        key = value
    if not key:
        raise InvalidKey("The Idempotency-Key is empty.")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"The Idempotency-Key is longer than {MAX_KEY_LENGTH} characters.")
    if not _KEY_CHARS.issuperset(key):
        raise InvalidKey(
            "The Idempotency-Key may contain only printable ASCII characters other than "
            'space, ", comma, ; and \\.'
        )
    return key


def principal_for(request: Any, func: PrincipalFunc | None) -> str:
    """Whose keys these are: the callable's answer, else the authenticated user."""
    if func is not None:
        value = str(func(request))
    else:
        user = getattr(request, "user", None)
        value = f"user:{user.pk}" if user is not None and user.is_authenticated else ANONYMOUS
    if len(value) > 255:
        value = "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    return value


# The order in which differing parts of a fingerprint are reported.
PARTS = ("method", "path", "query", "body")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _drop(data: Any, path: list[str]) -> None:
    head, *rest = path
    if not isinstance(data, dict) or head not in data:
        return
    if rest:
        _drop(data[head], rest)
    else:
        del data[head]


def _canonical_json(raw: bytes, exclude: Iterable[str]) -> bytes | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    for field in exclude:
        _drop(data, field.split("."))
    try:
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    except RecursionError:
        return None


def _pairs(data: QueryDict) -> list[tuple[str, str]]:
    return [(name, value) for name, values in data.lists() for value in values]


def _canonical_pairs(pairs: Iterable[tuple[str, str]], exclude: Iterable[str]) -> bytes:
    excluded = set(exclude)
    kept = sorted((k, v) for k, v in pairs if k not in excluded)
    return json.dumps(kept, separators=(",", ":")).encode()


def canonical_body(request: HttpRequest, exclude: Iterable[str] = ()) -> bytes:
    """JSON re-serialised with sorted keys, form fields sorted, multipart fields plus file
    digests; anything else as raw bytes. Each form is tagged so they never collide."""
    exclude = tuple(exclude)
    content_type = request.content_type or ""
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        # Parsed by Django, which caps the number of fields (DATA_UPLOAD_MAX_NUMBER_FIELDS),
        # and the raw stream of a multipart body may already have been consumed.
        pairs = _pairs(request.POST)
        for name in request.FILES:
            for upload in request.FILES.getlist(name):
                digest = hashlib.sha256()
                for chunk in upload.chunks():
                    digest.update(chunk)
                upload.seek(0)
                pairs.append((name, f"file:{upload.name}:{digest.hexdigest()}"))
        return b"form:" + _canonical_pairs(pairs, exclude)
    raw = request.body
    if content_type == "application/json" or content_type.endswith("+json"):
        canonical = _canonical_json(raw, exclude)
        if canonical is not None:
            return b"json:" + canonical
    return b"raw:" + raw


def fingerprint(
    request: HttpRequest, exclude: Iterable[str] = (), headers: Iterable[str] = ()
) -> dict[str, str]:
    """Digest of each part of the request, so a mismatch can name the parts that differ."""
    parts = {
        "method": _digest((request.method or "").encode()),
        "path": _digest(request.path.encode()),
        "query": _digest(_canonical_pairs(_pairs(request.GET), ())),
        "body": _digest(canonical_body(request, exclude)),
    }
    for name in headers:
        value = request.headers.get(name, "")
        parts[f"header:{name.lower()}"] = _digest(value.encode("latin-1", "replace"))
    return parts


def differing(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    names = [*PARTS, *sorted((set(stored) | set(current)) - set(PARTS))]
    return [name for name in names if stored.get(name) != current.get(name)]
