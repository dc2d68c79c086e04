"""The invariant, checked against the database at the end of a run:

every logical request answered 2xx has exactly one business effect, and no principal ever
saw another principal's response. Plus: no stored half-results, no secrets in stored
headers or in logs.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django_idempotency.storage import bodies
from tests.reliability.client import EFFECT_OR_REFUSAL, Attempt, Exchange
from tests.reliability.postgres import Database
from tests.reliability.traffic import DRF_ENDPOINTS

TABLES = {"/api/refunds/": "payments_refund"}
DEFAULT_TABLE = "payments_charge"
# The processor's webhook (chain profiles that settle) is no client's: its stored successes
# name their settlement row.
WEBHOOK_PATH = "/api/webhooks/processor/"
STORED_ROWS = {WEBHOOK_PATH: ("payments_settlement", "settlement")}
# The contract's "never Set-Cookie or authentication headers", written out independently.
SENSITIVE_HEADERS = frozenset(
    {
        "set-cookie",
        "cookie",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
    }
)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

# The method of an exactly-once task's records (django_idempotency.messaging.consumers).
TASK_METHOD = "TASK"

# Violation kinds, by what they break.
DUPLICATE = "duplicate"  # more than one effect for one logical request
LEAK = "leak"  # a principal saw or could read what is not theirs
OTHER = "other"  # lost effects, half-results, wrong answers
# What: a 2xx answered or stored for work that did not commit.
NO_COMMIT = "2xx without a commit"


@dataclass(frozen=True)
class Violation:
    kind: str
    what: str
    detail: str


@dataclass
class Findings:
    violations: list[Violation] = field(default_factory=list)
    unresolved: int = 0
    checked: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, what: str, detail: str) -> None:
        self.violations.append(Violation(kind, what, detail))

    def count(self, kind: str) -> int:
        return sum(1 for v in self.violations if v.kind == kind)


def table_for(path: str) -> str:
    return TABLES.get(path, DEFAULT_TABLE)


def check_exchanges(database: Database, exchanges: Sequence[Exchange]) -> Findings:
    """Compare what each client was told with what the database holds."""
    findings = Findings()
    with database.connect() as conn:
        users = dict(conn.execute("SELECT username, id FROM auth_user").fetchall())
        rows: dict[str, dict[int, list[tuple[int, int]]]] = {}
        for table in {DEFAULT_TABLE, *TABLES.values()}:
            found: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for amount, row_id, user_id in conn.execute(f"SELECT amount, id, user_id FROM {table}"):
                found[amount].append((row_id, user_id))
            rows[table] = found

    sent: dict[str, set[int]] = defaultdict(set)
    senders: dict[tuple[str, int], set[str]] = defaultdict(set)
    for exchange in exchanges:
        senders[table_for(exchange.path), exchange.amount].add(exchange.principal.username)
    for exchange in exchanges:
        table = table_for(exchange.path)
        sent[table].add(exchange.amount)
        effects = rows[table].get(exchange.amount, [])
        if len(senders[table, exchange.amount]) > 1:
            # Principals sent the same body under one key (a shape's stranger, on purpose):
            # each is judged by the rows it owns and by what it was answered.
            user_id = users.get(exchange.principal.username)
            effects = [row for row in effects if row[1] == user_id]
        _check_exchange(exchange, effects, users, findings)
    for table, found in rows.items():
        for amount in set(found) - sent[table]:
            findings.add(OTHER, "phantom row", f"{table}: amount {amount} was never sent")
    return findings


def _check_exchange(
    exchange: Exchange,
    rows: list[tuple[int, int]],
    users: dict[str, int],
    findings: Findings,
) -> None:
    label = f"{exchange.kind} {exchange.path} amount {exchange.amount} ({exchange.principal.auth})"
    findings.checked[exchange.expect] += 1
    if exchange.expect == "any":  # the unprotected baseline: no promise to keep
        return
    if len(rows) > 1:
        findings.add(DUPLICATE, "several effects", f"{label}: {len(rows)} rows")
    answered = [a for a in exchange.attempts if a.ok]
    if len({a.body for a in answered}) > 1:
        findings.add(OTHER, "replay differs", f"{label}: {len(answered)} 2xx answers differ")
    for attempt in exchange.attempts:
        _check_answer(exchange, attempt, label, findings)
    user_id = users.get(exchange.principal.username)
    for row_id, owner in rows:
        if owner != user_id:
            findings.add(LEAK, "effect on another principal", f"{label}: row {row_id}")

    if exchange.expect == EFFECT_OR_REFUSAL:
        _effect_or_refusal(exchange, answered, rows, label, findings)
    elif exchange.expect == "effect":
        if not answered:
            findings.unresolved += 1
            findings.add(OTHER, "never answered 2xx", f"{label}: {_outcomes(exchange)}")
            return
        if not rows:
            findings.add(OTHER, NO_COMMIT, f"{label}: no committed row")
        body = _json(answered[0].body)
        if body.get("user") != exchange.principal.username:
            who = body.get("user")
            findings.add(LEAK, "another principal's response", f"{label}: user {who!r}")
        if body.get("amount") != exchange.amount:
            findings.add(LEAK, "another request's response", f"{label}: got {body.get('amount')}")
        if rows and body.get("id") != rows[0][0]:
            findings.add(OTHER, "response names another row", f"{label}: id {body.get('id')}")
    elif exchange.expect == "refused":
        final = exchange.final
        if answered:
            findings.add(LEAK, "reused key executed or replayed", f"{label}: {_outcomes(exchange)}")
        elif final is None or final.status != 422 or final.problem != "key-reused":
            findings.unresolved += 1
            findings.add(OTHER, "reused key not refused", f"{label}: {_outcomes(exchange)}")
        if rows:
            findings.add(DUPLICATE, "reused key wrote", f"{label}: {len(rows)} rows")
    elif exchange.expect == "none":
        if answered:
            what = NO_COMMIT if exchange.kind == "rolled back" else "answered 2xx unprotected"
            findings.add(OTHER, what, f"{label}: {_outcomes(exchange)}")
        if rows:
            findings.add(OTHER, "effect while refused", f"{label}: {len(rows)} rows")


def _effect_or_refusal(
    exchange: Exchange,
    answered: list[Attempt],
    rows: list[tuple[int, int]],
    label: str,
    findings: Findings,
) -> None:
    """One effect of its own, or refused with nothing executed (a deployment shape)."""
    if not answered:
        final = exchange.final
        if final is None or not final.refusal:
            findings.unresolved += 1
            what = "neither an effect nor a refusal"
            findings.add(OTHER, what, f"{label}: {_outcomes(exchange)}")
        if rows:
            findings.add(OTHER, "effect while refused", f"{label}: {len(rows)} rows")
        return
    body = _json(answered[0].body)
    if body.get("user") != exchange.principal.username:
        # Another principal's stored answer, replayed: nothing else in it is this one's.
        who = body.get("user")
        findings.add(LEAK, "another principal's response", f"{label}: user {who!r}")
        return
    if not rows:
        findings.add(OTHER, NO_COMMIT, f"{label}: no committed row")
    elif body.get("id") != rows[0][0]:
        findings.add(OTHER, "response names another row", f"{label}: id {body.get('id')}")


def _check_answer(exchange: Exchange, attempt: Attempt, label: str, findings: Findings) -> None:
    """Every answer must be one the contract allows for this exchange."""
    status = attempt.status
    if attempt.replayed and attempt.sets_cookie:
        findings.add(LEAK, "replay carried Set-Cookie", label)
    first_answer = attempt.ok and not attempt.replayed
    if exchange.kind == "cookie" and first_answer and not attempt.sets_cookie:
        findings.add(OTHER, "set_cookie switch set no cookie", label)
    # Only on the DRF views, where the mixin answers for authentication too: the plain
    # view's token check is the testproject's own code, run before @idempotent, and a
    # database outage there is Django's plain 500.
    if (
        exchange.kind == "rolled back"
        and exchange.path in DRF_ENDPOINTS
        and status == 500
        and attempt.problem is None
    ):
        findings.add(OTHER, "rolled-back work answered 500 without problem+json", label)
    if status == 503:
        if attempt.problem != "store-unavailable":
            findings.add(OTHER, "503 that is not store-unavailable", label)
    elif status == 409:
        if attempt.problem != "in-progress" or attempt.retry_after is None:
            findings.add(OTHER, "409 that is not in-progress with Retry-After", label)
    elif status == 422:
        if exchange.expect != "refused":
            # A key blocked by the same principal's other request, or by another's.
            kind = LEAK if exchange.kind == "cross-principal" else OTHER
            findings.add(kind, "fresh request refused as a reused key", label)
    elif status is not None and 400 <= status < 500 and exchange.expect != "none":
        if exchange.expect == EFFECT_OR_REFUSAL and attempt.refusal:
            return
        findings.add(OTHER, f"unexpected {status}", f"{label}: {attempt.body[:200]!r}")


def _outcomes(exchange: Exchange) -> str:
    return " ".join(a.outcome for a in exchange.attempts) or "never sent"


def _json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def check_records(database: Database, exchanges: Sequence[Exchange] = ()) -> Findings:
    """The stored records themselves: one per key, never a half-result, no secrets.
    ``exchanges`` name the request a key stored twice belongs to."""
    findings = Findings()
    kinds = {e.key: e.kind for e in exchanges}
    with database.connect() as conn:
        for scope, key, path, key_count in conn.execute(
            "SELECT scope, key, min(path), count(*) FROM django_idempotency_record "
            "GROUP BY scope, key HAVING count(*) > 1"
        ):
            sent = f"{kinds[key]} {path}" if key in kinds else path
            findings.add(DUPLICATE, "key stored twice", f"{sent}, {scope}: {key_count} records")
        for status, code, count in conn.execute(
            "SELECT status, response_code, count(*) FROM django_idempotency_record "
            "WHERE status <> 1 OR response_code IS NULL OR response_code >= 500 "
            "GROUP BY 1, 2"
        ):
            findings.add(OTHER, "half-result stored", f"status {status}, code {code}: {count}")
        names = [
            name
            for (name,) in conn.execute(
                "SELECT DISTINCT lower(h ->> 0) FROM django_idempotency_record r, "
                "jsonb_array_elements(r.response_headers) h"
            )
        ]
        for name in sorted(set(names) & SENSITIVE_HEADERS):
            findings.add(LEAK, "sensitive header stored", name)
        findings.checked["stored header names"] = len(names)
        # A stored success must describe a committed row: no record outlives its effect.
        ids: dict[str, set[int]] = {}
        for table in {DEFAULT_TABLE, *TABLES.values(), *(t for t, _ in STORED_ROWS.values())}:
            ids[table] = {i for (i,) in conn.execute(f"SELECT id FROM {table}")}
        # Requests' records only: an exactly-once task's result names its own rows
        # (chain_checks.py checks those).
        stored = conn.execute(
            "SELECT path, response_body, body_encoding FROM django_idempotency_record "
            "WHERE response_code BETWEEN 200 AND 299 AND method <> %s",
            [TASK_METHOD],
        ).fetchall()
    for path, body, encoding in stored:
        table, key = STORED_ROWS.get(path, (table_for(path), "id"))
        row_id = stored_json(body, encoding).get(key)
        findings.checked["stored successes"] += 1
        if row_id not in ids[table]:
            findings.add(OTHER, NO_COMMIT, f"stored success without its row: {path} id {row_id}")
    return findings


def stored_json(body: bytes | None, encoding: str) -> dict[str, Any]:
    """A record's stored body, as JSON."""
    return _json(bodies.decode_body(body, encoding))


def scan_logs(
    logs: Iterable[str], keys: Iterable[str], secrets: Iterable[str], canary: str
) -> Findings:
    """Whole keys, credentials and request bodies must not reach the logs."""
    findings = Findings()
    text = "\n".join(logs)
    findings.checked["log bytes"] = len(text)
    logged_uuids = set(UUID.findall(text))
    leaked_keys = logged_uuids & set(keys)
    if leaked_keys:
        findings.add(LEAK, "whole key in logs", f"{len(leaked_keys)} keys")
    leaked_secrets = [s for s in set(secrets) if s and s in text]
    if leaked_secrets:
        findings.add(LEAK, "credential in logs", f"{len(leaked_secrets)} credentials")
    if canary in text:
        findings.add(LEAK, "request body in logs", f"{text.count(canary)} occurrences")
    return findings
