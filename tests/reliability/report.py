"""What a run found, as JSON and as Markdown."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Check:
    """A named property a phase proved, or failed to; ``passed`` is None when the thing
    to check does not exist in this checkout (say, the admin before it is written)."""

    name: str
    passed: bool | None
    detail: str


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(share: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(share * len(ordered)))] * 1000, 1)

    return {"count": len(ordered), "p50": at(0.50), "p90": at(0.90), "p99": at(0.99),
            "max": at(1.0)}  # fmt: skip


@dataclass
class Report:
    profile: str
    started: str
    environment: dict[str, str]
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    fault_errors: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    final_outcomes: dict[str, int] = field(default_factory=dict)
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    duplicates: int = 0
    leaks: int = 0
    other_violations: int = 0
    unresolved: int = 0
    violations: list[dict[str, str]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    contention: dict[str, Any] = field(default_factory=dict)
    slowest: list[str] = field(default_factory=list)
    # The side-effect chain's figures (chain profiles): charges, captures, ledger rows,
    # outbox rows published, publishes and redeliveries.
    chain: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (
            self.duplicates == 0
            and self.leaks == 0
            and self.other_violations == 0
            and self.unresolved == 0
            and all(check.passed is not False for check in self.checks)
        )

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "passed": self.passed}, indent=2, sort_keys=True)

    def write(self, path: Path) -> tuple[Path, Path]:
        """Write ``path`` (Markdown) and the same name with ``.json``; return both."""
        markdown, data = path.with_suffix(".md"), path.with_suffix(".json")
        markdown.write_text(self.to_markdown())
        data.write_text(self.to_json() + "\n")
        return markdown, data

    def to_markdown(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"# Reliability run: {self.profile} profile",
            "",
            f"**{verdict}**: duplicates found **{self.duplicates}**, leaks found "
            f"**{self.leaks}**, other violations **{self.other_violations}**, logical "
            f"requests left unanswered after recovery **{self.unresolved}**" + ".",
            "",
            f"Started {self.started}, ran {self.seconds / 60:.1f} minutes.",
            "",
            "## Environment",
            "",
            *_table(["", ""], self.environment.items()),
            "## Requests",
            "",
            *_table(["", "count"], self.requests.items()),
            "By kind of logical request:",
            "",
            *_table(["kind", "logical requests"], sorted(self.kinds.items())),
            "By endpoint:",
            "",
            *_table(["endpoint", "logical requests"], sorted(self.endpoints.items())),
            *_chain_section(self.chain),
            "## Faults injected",
            "",
            *_table(["fault", "count"], sorted(self.faults.items())),
        ]
        if self.fault_errors:
            lines += ["Injector errors (the run went on):", ""]
            lines += [f"- {error}" for error in self.fault_errors[:20]] + [""]
        lines += [
            "## Outcomes",
            "",
            "Every HTTP attempt, by status (`timeout`: the client's read timeout fired; "
            "`connection-error`: the connection was refused or dropped):",
            "",
            *_table(["outcome", "attempts"], sorted(self.outcomes.items())),
            "Final outcome of each logical request:",
            "",
            *_table(["outcome", "logical requests"], sorted(self.final_outcomes.items())),
            "## Latency (ms)",
            "",
            *_table(
                ["measured", "count", "p50", "p90", "p99", "max"],
                [
                    (name, *(values.get(k, "") for k in ("count", "p50", "p90", "p99", "max")))
                    for name, values in self.latency_ms.items()
                ],
            ),
            "## Checks",
            "",
            *_table(
                ["check", "result", "detail"],
                [
                    (c.name, {True: "pass", False: "**FAIL**", None: "n/a"}[c.passed], c.detail)
                    for c in self.checks
                ],
            ),
        ]
        scaling = self.contention.get("scaling")
        if scaling:
            lines += [
                "## Distinct keys at once",
                "",
                "Each request holds its key and its transaction open for "
                f"{self.contention.get('scaling_delay_ms')} ms (`delay_ms`). Wall time of N "
                "requests sent at once on distinct keys, through the idempotent endpoint and "
                "through the unprotected baseline; a global lock would make the idempotent "
                "time N x the delay.",
                "",
                *_table(
                    ["N", "idempotent (s)", "baseline (s)", "serialised would be (s)"],
                    [(r["n"], r["idempotent"], r["baseline"], r["serial"]) for r in scaling],
                ),
            ]
        lines += ["## Phases (s)", "", *_table(["phase", "seconds"], self.phases.items())]
        if self.slowest:
            lines += [
                "## Slowest logical requests",
                "",
                "Attempts in order (`r`: answered as a replay).",
                "",
                *(f"- {line}" for line in self.slowest),
                "",
            ]
        if self.violations:
            lines += ["## Violations", "", *_table(["kind", "what", "detail"], [
                (v["kind"], v["what"], v["detail"]) for v in self.violations
            ])]  # fmt: skip
        return "\n".join(lines).rstrip() + "\n"


def _chain_section(chain: dict[str, int]) -> list[str]:
    if not chain:
        return []
    return [
        "## The chain beyond the request",
        "",
        "After the recovery, which ran the relays and the consumers without faults until the "
        "outbox was drained and the queue empty. A publish is a message put on the broker "
        "(each copy has its own tag: kombu's delivery tag, the NATS stream sequence, the RQ "
        "job id); a redelivery is the broker handing out a copy it had delivered already "
        "(visibility timeout or ack wait, a consumer lost, a delivery given back; RQ never "
        "redelivers: the relay's redrive publishes a new copy).",
        "",
        *_table(["", "count"], chain.items()),
    ]


def _table(header: Sequence[str], rows: Any) -> list[str]:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return [*lines, ""]
