"""What a kept result becomes in the store: its record, encoded and, with keys set, sealed;
and the keys that seal it."""

from __future__ import annotations

import logging
from typing import Any

from django_idempotency.conf import conf
from django_idempotency.engine.errors import Misconfigured
from django_idempotency.engine.work import Result, Work, view_name
from django_idempotency.storage import bodies, records, sealing

logger = logging.getLogger("django_idempotency")


def keyring(sender: Any, kind: str = "view") -> sealing.Keyring | None:
    """The configured keys, or None when responses are stored plain; malformed keys refuse
    the work (never a plain write instead: the operator asked for responses sealed)."""
    raw = conf.ENCRYPTION_KEYS
    if not raw:
        return None
    try:
        return sealing.keyring(raw)
    except sealing.MalformedKeys as exc:
        logger.error(
            "The idempotent %s %s was refused: %s Fix IDEMPOTENCY_ENCRYPTION_KEYS "
            "(`manage.py check` says the same).",
            kind,
            view_name(sender),
            exc,
        )
        raise Misconfigured(
            "The server's encryption keys for stored responses are invalid, so the "
            "request was not processed."
        ) from exc


def finished(
    using: str,
    work: Work,
    result: Result,
    claimed: records.Claimed,
    ring: sealing.Keyring | None,
) -> records.Finished:
    """The record of ``work``'s ``result``, for the claim it won."""
    assert claimed.created_at is not None
    body, encoding = bodies.encode_body(
        using,
        result.body,
        conf.COMPRESS_MIN_BYTES,
        sealed=ring is not None,
        codec=conf.BODY_COMPRESSION,
    )
    headers: list[list[str]] | None = result.headers
    if ring is not None:
        body, encoding = sealing.seal(
            ring,
            scope=work.principal,
            key=work.key,
            status=result.status,
            headers=result.headers,
            body=body,
            encoding=encoding,
        )
        headers = None  # inside the envelope
    return records.Finished(
        principal=work.principal,
        key=work.key,
        method=work.method,
        path=work.path,
        fingerprint=work.fingerprint,
        created_at=claimed.created_at,
        expires_at=claimed.created_at + work.ttl,
        code=result.status,
        headers=headers,
        body=body,
        body_encoding=encoding,
        version=work.version,
        generation=claimed.generation,
    )
