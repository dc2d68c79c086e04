"""What makes two requests "the same": method, path, query, canonical body, chosen headers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl

from django.http import HttpRequest

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


def _canonical_pairs(pairs: Iterable[tuple[str, str]], exclude: Iterable[str]) -> bytes:
    excluded = set(exclude)
    kept = sorted((k, v) for k, v in pairs if k not in excluded)
    return json.dumps(kept, separators=(",", ":")).encode()


def canonical_body(request: HttpRequest, exclude: Iterable[str] = ()) -> bytes:
    """JSON re-serialised with sorted keys, form fields sorted, multipart fields plus file
    digests; anything else as raw bytes. Each form is tagged so they never collide."""
    exclude = tuple(exclude)
    content_type = request.content_type or ""
    if content_type == "multipart/form-data":
        # Parsed by Django: the raw stream may already have been consumed (CSRF, DRF).
        pairs = [(k, v) for k in request.POST for v in request.POST.getlist(k)]
        for name in request.FILES:
            for upload in request.FILES.getlist(name):
                digest = hashlib.sha256()
                for chunk in upload.chunks():
                    digest.update(chunk)
                upload.seek(0)
                pairs.append((name, f"file:{upload.name}:{digest.hexdigest()}"))
        return b"multipart:" + _canonical_pairs(pairs, exclude)
    raw = request.body
    if content_type == "application/x-www-form-urlencoded":
        pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
        return b"form:" + _canonical_pairs(pairs, exclude)
    if content_type == "application/json" or content_type.endswith("+json"):
        canonical = _canonical_json(raw, exclude)
        if canonical is not None:
            return b"json:" + canonical
    return b"raw:" + raw


def fingerprint(
    request: HttpRequest, exclude: Iterable[str] = (), headers: Iterable[str] = ()
) -> dict[str, str]:
    """Digest of each part of the request, so a mismatch can name the parts that differ."""
    query = parse_qsl(request.META.get("QUERY_STRING", ""), keep_blank_values=True)
    parts = {
        "method": _digest((request.method or "").encode()),
        "path": _digest(request.path.encode()),
        "query": _digest(_canonical_pairs(query, ())),
        "body": _digest(canonical_body(request, exclude)),
    }
    for name in headers:
        value = request.headers.get(name, "")
        parts[f"header:{name.lower()}"] = _digest(value.encode("latin-1", "replace"))
    return parts


def differing(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    names = [*PARTS, *sorted((set(stored) | set(current)) - set(PARTS))]
    return [name for name in names if stored.get(name) != current.get(name)]
