"""What makes two requests "the same": method, path, query, canonical body, chosen headers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from django.http import HttpRequest, QueryDict

# The order in which differing parts are reported.
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
