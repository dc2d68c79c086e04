"""Errors the engine raises; each knows its problem type, title and HTTP status, and the
outcome label under which telemetry counts it."""

from __future__ import annotations

from typing import Any

# Outcome labels: how a keyed request or delivery ended (docs/observability.md, "Outcomes").
WON = "won"
REPLAYED = "replayed"
CONFLICT = "conflict"
REUSED = "reused"
EXPIRED = "expired"
REFUSED = "refused"
ROLLED_BACK_OUTCOME = "rolled-back"
STORE_UNAVAILABLE_OUTCOME = "store-unavailable"
FAILED = "failed"  # the work raised: the claim and the work's writes were rolled back
ERROR = "error"  # anything else raised by the engine (a misconfiguration)
# A duplicate that gave up waiting, or a request that found the store down, is told to
# come back after this many seconds (Retry-After).
RETRY_AFTER_SECONDS = 1


class IdempotencyError(Exception):
    status: int = 400
    name: str = ""
    title: str = ""
    # Stripe's error object for the same situation, used by the "stripe" error format.
    stripe_status: int = 400
    stripe_type: str = "invalid_request_error"
    stripe_code: str = ""
    outcome: str = REFUSED

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra
        self.headers: dict[str, str] = {}


class MissingKey(IdempotencyError):
    status, name, title = 400, "missing-key", "Idempotency-Key is missing"
    stripe_code = "idempotency_key_missing"


class InvalidKey(IdempotencyError):
    status, name, title = 400, "invalid-key", "Idempotency-Key is malformed"
    stripe_code = "idempotency_key_invalid"


class KeyReused(IdempotencyError):
    status, name, title = 422, "key-reused", "Idempotency-Key is already used"
    stripe_status, stripe_type, stripe_code = 400, "idempotency_error", ""
    outcome = REUSED


class InProgress(IdempotencyError):
    status, name, title = 409, "in-progress", "A request is outstanding for this Idempotency-Key"
    stripe_status, stripe_code = 409, "idempotency_key_in_use"
    outcome = CONFLICT


class KeyExpired(IdempotencyError):
    status, name, title = 410, "key-expired", "Idempotency-Key has expired"
    stripe_status, stripe_code = 410, "idempotency_key_expired"
    outcome = EXPIRED


class VersionChanged(IdempotencyError):
    # The key's work ran under another response version: its effect stands, but its
    # response is not one this server may replay (contract 8).
    status, name = 410, "response-version-changed"
    title = "The stored response is of another version"
    stripe_status, stripe_code = 410, "idempotency_response_version_changed"
    outcome = EXPIRED


class StoreUnavailable(IdempotencyError):
    status, name, title = 503, "store-unavailable", "The idempotency store is unavailable"
    stripe_status, stripe_type, stripe_code = 503, "api_error", "idempotency_store_unavailable"
    outcome = STORE_UNAVAILABLE_OUTCOME


class PrincipalMissing(IdempotencyError):
    # A misconfigured view, not a client error: the principal callable returned nothing, so
    # running the request would put it in a scope shared with others.
    status, name = 500, "principal-missing"
    title = "The view's principal callable returned no principal"
    stripe_status, stripe_type, stripe_code = 500, "api_error", "idempotency_principal_missing"


class Misconfigured(IdempotencyError):
    # The deployment cannot keep the promise (an isolation level, an anonymous principal on a
    # request with credentials): refused before anything runs, and logged with the fix.
    status, name, title = 500, "misconfigured", "The idempotency guarantee cannot hold here"
    stripe_status, stripe_type, stripe_code = 500, "api_error", "idempotency_misconfigured"


class RolledBack(IdempotencyError):
    status, name, title = 500, "rolled-back", "The request's work was rolled back"
    stripe_status, stripe_type, stripe_code = 500, "api_error", "idempotency_rolled_back"
    outcome = ROLLED_BACK_OUTCOME
