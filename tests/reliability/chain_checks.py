"""The invariant beyond the request (chain profiles), checked once the recovery has drained
the outbox and the queue:

every committed charge (so every charge answered 2xx, which ``checks.check_exchanges`` ties to
its committed row) has exactly one capture at the processor, exactly one outbox row and
exactly one ledger row; every outbox row was published and delivered at least once; the
processor captured nothing for a charge that never committed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.broker_log import BrokerLog
from tests.reliability.checks import (
    DUPLICATE,
    NO_COMMIT,
    OTHER,
    TASK_METHOD,
    Findings,
    stored_json,
)
from tests.reliability.postgres import Database

# Messages queued again: a visibility timeout ran out, a delivery was rejected, a worker lost.
GIVEN_BACK = "messages the broker queued again (visibility timeout, rejected, worker lost)"


@dataclass(frozen=True)
class Delivery:
    """A message a worker received: its task id (the outbox message id), the delivery tag
    its publish got, and whether the broker had handed it out before."""

    id: str
    tag: str
    redelivered: bool


@dataclass
class ChainState:
    """What the chain's stores hold after the recovery."""

    # charge id -> amount (each logical request of a run has its own amount)
    charges: dict[int, int]
    # amount -> captures the processor made for it
    captures: Counter[int]
    # outbox message id -> (the charge it posts, published)
    outbox: dict[str, tuple[Any, bool]]
    # ledger row id -> (charge id, message id)
    ledger: dict[int, tuple[int, str]]
    # message id -> the ledger row id the exactly-once task's stored result names
    results: dict[str, Any]
    deliveries: list[Delivery]
    # what the broker did with each message (its append-only file, replayed)
    broker: BrokerLog = field(default_factory=BrokerLog)
    # outbox message id -> how often the relay's redrive put it back to be published again
    redriven: dict[str, int] = field(default_factory=dict)
    # outbox message ids of the dead letters (none is caused on purpose)
    dead: set[str] = field(default_factory=set)
    # charge id -> settlements by the processor's webhook; None: the run settles nothing
    settlements: Counter[int] | None = None


def collect(
    database: Database,
    captures: list[dict[str, Any]],
    deliveries: list[Delivery],
    broker: BrokerLog,
    *,
    settled: bool = False,
    results: bool = True,
) -> ChainState:
    """``results=False``: the consumer keeps no result (a NATS handler's return value has no
    one to go to), so there is none to check."""
    with database.connect() as conn:
        rows = conn.execute("SELECT id, amount FROM payments_charge")
        charges = {int(charge): int(amount) for charge, amount in rows}
        rows = list(
            conn.execute(
                "SELECT id, args, published_at IS NOT NULL, redrives, dead_at IS NOT NULL "
                "FROM django_idempotency_outbox"
            )
        )
        outbox = {
            str(m): (args[0] if args else None, bool(published))
            for m, args, published, _, _ in rows
        }
        redriven = {str(message): int(again) for message, _, _, again, _ in rows if again}
        dead = {str(message) for message, _, _, _, dead in rows if dead}
        ledger = {
            int(entry): (int(charge), str(message))
            for entry, charge, message in conn.execute(
                "SELECT id, charge_id, message_id FROM payments_ledgerentry"
            )
        }
        settlements = (
            Counter(
                int(charge)
                for (charge,) in conn.execute("SELECT charge_id FROM payments_settlement")
            )
            if settled
            else None
        )
        stored = {
            str(key): stored_json(body, encoding).get("entry")
            for key, body, encoding in conn.execute(
                "SELECT key, response_body, body_encoding FROM django_idempotency_record "
                "WHERE method = %s AND response_code BETWEEN 200 AND 299",
                [TASK_METHOD],
            )
        }
    captured = Counter(int(c["amount"]) for c in captures)
    return ChainState(
        charges, captured, outbox, ledger, stored if results else {}, deliveries, broker,
        redriven, dead, settlements,
    )  # fmt: skip


def check_chain(state: ChainState) -> Findings:
    findings = Findings()
    outbox_rows = Counter(charge for charge, _ in state.outbox.values())
    ledger_rows = Counter(charge for charge, _ in state.ledger.values())
    for charge, amount in state.charges.items():
        label = f"charge {charge} (amount {amount})"
        _exactly_one(findings, state.captures[amount], "capture at the processor", label)
        _exactly_one(findings, outbox_rows[charge], "outbox row", label)
        # Even for a message the broker dropped: the relay's redrive publishes it again.
        _exactly_one(findings, ledger_rows[charge], "ledger row", label)
        if state.settlements is not None:
            _exactly_one(findings, state.settlements[charge], "settlement", label)
    committed = set(state.charges.values())
    for amount, count in sorted(state.captures.items()):
        if amount not in committed:
            findings.add(OTHER, "capture without a committed charge",
                         f"amount {amount}: {count} captures")  # fmt: skip
    delivered = {d.id for d in state.deliveries}
    dropped = set(state.broker.dropped.values())
    for message, (charge, published) in sorted(state.outbox.items()):
        if message in state.dead:
            findings.add(OTHER, "outbox row dead-lettered", f"message {message}")
        elif not published:
            findings.add(OTHER, "outbox row never published", f"message {message}")
        elif message not in delivered and message not in dropped:
            findings.add(OTHER, "published outbox row never delivered", f"message {message}")
        if charge not in state.charges:
            findings.add(OTHER, "outbox row without its charge", f"message {message}: {charge}")
    for charge, message in state.ledger.values():
        if message not in state.outbox:
            findings.add(OTHER, "ledger row from no outbox message",
                         f"charge {charge}: message {message}")  # fmt: skip
    dropped_unseen = lost(state)
    for message in sorted(set(dropped_unseen.values()) - recovered(state, dropped_unseen)):
        findings.add(OTHER, "message the broker lost, never delivered again", f"message {message}")
    # A task's stored result, which a redelivery is answered with, must name its committed row.
    for message, entry in sorted(state.results.items()):
        if state.ledger.get(entry, (None, None))[1] != message:
            detail = f"task result without its ledger row: message {message}, entry {entry}"
            findings.add(OTHER, NO_COMMIT, detail)
    findings.checked["charges"] = len(state.charges)
    findings.checked["outbox rows"] = len(state.outbox)
    findings.checked["task results"] = len(state.results)
    return findings


def lost(state: ChainState) -> dict[str, str]:
    """Delivery tag -> message id: the deliveries the broker dropped and no worker received
    (one that received its message runs it, though the broker never recorded it)."""
    received = {d.tag for d in state.deliveries}
    return {tag: m for tag, m in state.broker.dropped.items() if tag not in received}


def recovered(state: ChainState, lost_tags: dict[str, str]) -> set[str]:
    """The messages of ``lost_tags`` (``lost()``) a worker received from another publish
    (the relay's redrive, or a relay killed before marking its batch)."""
    messages = set(lost_tags.values())
    return {d.id for d in state.deliveries if d.id in messages and d.tag not in lost_tags}


def _exactly_one(findings: Findings, count: int, what: str, label: str) -> None:
    if count > 1:
        findings.add(DUPLICATE, f"more than one {what}", f"{label}: {count}")
    elif count == 0:
        findings.add(OTHER, f"no {what}", label)


def figures(state: ChainState) -> dict[str, int]:
    """The chain's counts for the report."""
    published = Counter(state.broker.tags.values())
    dropped_unseen = lost(state)
    counts = {
        "charges committed": len(state.charges),
        "captures at the processor": sum(state.captures.values()),
        "ledger rows": len(state.ledger),
        "outbox rows": len(state.outbox),
        "outbox rows published": sum(published for _, published in state.outbox.values()),
        "outbox dead letters": len(state.dead),
    }
    if state.settlements is not None:
        counts["settlements"] = sum(state.settlements.values())
    if state.broker.kept:  # what the broker's log says (Redis' append-only file)
        counts |= {
            "publishes the broker accepted": sum(published.values()),
            "outbox rows published more than once": sum(n > 1 for n in published.values()),
            GIVEN_BACK: state.broker.given_back,
            "messages the broker dropped after a worker took them": len(state.broker.dropped),
            "dropped messages no worker received (lost)": len(set(dropped_unseen.values())),
            "lost messages delivered again by another publish": len(
                recovered(state, dropped_unseen)
            ),
        }
    return counts | {
        "outbox rows the redrive published again": len(state.redriven),
        "deliveries to workers": len(state.deliveries),
        "deliveries flagged redelivered": sum(d.redelivered for d in state.deliveries),
        "outbox rows delivered more than once": sum(
            n > 1 for n in Counter(d.id for d in state.deliveries).values()
        ),
    }
