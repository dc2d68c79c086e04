"""What a claim that was not won decides: replay the stored result, or refuse (in progress,
expired, reused), each logged and signalled."""

from __future__ import annotations

import logging
from typing import Any

from django_idempotency import signals
from django_idempotency.engine.errors import (
    RETRY_AFTER_SECONDS,
    IdempotencyError,
    InProgress,
    KeyExpired,
    KeyReused,
    Misconfigured,
    VersionChanged,
)
from django_idempotency.engine.work import Decision, Refuse, Replay, Work
from django_idempotency.storage import records, sealing

logger = logging.getLogger("django_idempotency")


def short(key: str) -> str:
    # Logs never carry a whole key: keys can be guessable and are bearer-like.
    return key[:6] + "…" if len(key) > 6 else "…"


def decide(
    claimed: records.Claimed,
    work: Work,
    *,
    sender: Any,
    context: Any,
    waited: float = 0.0,
    ring: sealing.Keyring | None = None,
) -> Decision:
    """What a claim that was not won answers: the stored result (``Replay``), or ``Refuse``
    (in progress, expired, reused, unreadable); ``context`` is what signals carry as
    ``request``, ``ring`` the keys that open a sealed record."""
    record = claimed.record
    about = {"key": work.key, "principal": work.principal}
    if claimed.outcome is records.Outcome.BUSY:
        logger.info(
            "Idempotency key %s is in progress; gave up after %.2fs", short(work.key), waited
        )
        signals.request_conflicted.send_robust(sender, request=context, waited=waited, **about)
        error: IdempotencyError = InProgress(
            "A request with this Idempotency-Key is still being processed. Retry later "
            "with the same key."
        )
        error.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return Refuse(error)
    if claimed.outcome is records.Outcome.EXPIRED:
        return Refuse(
            KeyExpired(
                "This Idempotency-Key has expired; its outcome can no longer be replayed. "
                "Check whether the first request took effect before retrying with a new "
                "key."
            )
        )
    assert record is not None
    if claimed.outcome is records.Outcome.STALE:
        # unstale() kept it: the same request, already run under another version.
        logger.info(
            "Idempotency key %s has a record of another response version than %r; refused "
            "(410) rather than run again",
            short(work.key),
            work.version,
        )
        return Refuse(
            VersionChanged(
                "This Idempotency-Key's request was already processed, but its response was "
                "stored under another response version and cannot be replayed; it was not "
                "processed again. Look the resource up (GET) instead of retrying.",
            )
        )
    changed = work.differing(record.fingerprint)
    if changed:
        logger.info("Idempotency key %s reused with different %s", short(work.key), changed)
        signals.key_reused.send_robust(sender, request=context, differing=changed, **about)
        return Refuse(key_reused(changed))
    try:
        record = sealing.opened(record, ring, scope=work.principal, key=work.key)
    except sealing.NotSealed as exc:
        # Not written by a sealing server (or not by this app): never replayed. Nor run
        # again, since it may stand for a first execution from before the keys were set.
        logger.error(
            "Idempotency key %s has a stored response that was refused: %s. A record written "
            "before the keys were set is sealed by `manage.py idempotency_reencrypt`; any "
            "other was not written by a server with the keys: check who writes to the "
            "records table.",
            short(work.key),
            exc,
        )
        return Refuse(
            Misconfigured(
                "The stored response for this Idempotency-Key is not sealed as this server "
                "requires, so it was not replayed and the request was not processed."
            )
        )
    except sealing.Unreadable as exc:
        # Never run again instead: the first execution took effect.
        logger.critical(
            "Idempotency key %s has a stored response that cannot be replayed: %s; the "
            "request was refused, and will be until the key that sealed it is listed in "
            "IDEMPOTENCY_ENCRYPTION_KEYS again (or the record expires).",
            short(work.key),
            exc,
        )
        return Refuse(
            Misconfigured(
                "The stored response for this Idempotency-Key cannot be read on this server, "
                "so the request was not processed."
            )
        )
    logger.info("Replayed idempotency key %s", short(work.key))
    signals.response_replayed.send_robust(
        sender, request=context, status=record.response_code, **about
    )
    return Replay.of(record)


def key_reused(changed: list[str]) -> KeyReused:
    """The refusal of a key stored for another request, which differs in ``changed``."""
    return KeyReused(
        "This Idempotency-Key was already used for a different request. Use a new key for a "
        "new request.",
        differing=changed,
    )


def unstale(using: str, work: Work, claimed: records.Claimed) -> records.Claimed:
    """A record of another version (contract 8): another request on the key is a reused
    key, whatever the versions (a view's version is no other view's); the same request
    stays stale (410 response-version-changed: its work ran, and never runs again), unless
    the view opted in to running anew (its effect is itself idempotent)."""
    assert claimed.record is not None
    if work.differing(claimed.record.fingerprint):
        return records.Claimed(records.Outcome.FOUND, record=claimed.record)
    if work.rerun_other_versions:
        return records.reclaim(using, claimed, principal=work.principal, key=work.key)
    return claimed
