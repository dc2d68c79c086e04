"""What a benchmark hands back, the statistics it needs, and how the results are shown and kept."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile: an observed value, never an interpolation."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@dataclass
class Check:
    """One ratio against its target: ``value <= target`` or ``value >= target``."""

    name: str
    value: float
    target: float
    at_most: bool
    note: str = ""
    # "x" for a ratio; "ms" for a time.
    unit: str = "x"

    @property
    def passed(self) -> bool:
        return self.value <= self.target if self.at_most else self.value >= self.target

    def describe(self) -> str:
        sign = "<=" if self.at_most else ">="
        verdict = "PASS" if self.passed else "FAIL"
        note = f"  ({self.note})" if self.note else ""
        unit = self.unit if self.unit == "x" else " " + self.unit
        target = f"target {sign} {self.target:.2f}{unit}"
        return f"{self.name:<44} {self.value:6.2f}{unit}   {target}   {verdict}{note}"


@dataclass
class Section:
    """A benchmark's outcome: a table for people, checks with verdicts, and raw data."""

    title: str
    header: list[str]
    rows: list[list[str]]
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # More tables from the same run, printed after the first: (title, header, rows).
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.errors and all(check.passed for check in self.checks)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(section: Section) -> str:
    parts = [f"== {section.title} ==", table(section.header, section.rows)]
    for title, header, rows in section.tables:
        parts += ["", f"-- {title} --", table(header, rows)]
    if section.tables:
        parts.append("")
    parts += section.notes
    parts += [check.describe() for check in section.checks]
    parts += [f"ERROR: {error}" for error in section.errors]
    return "\n".join(parts)


def environment() -> dict[str, Any]:
    """What the figures depend on besides the code: the machine and how busy it was."""
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    return {
        "commit": commit + ("-dirty" if dirty else ""),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }


def save(sections: list[Section], settings: dict[str, Any], started: datetime) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{started:%Y%m%dT%H%M%SZ}.json"
    document = {
        "started": started.isoformat(),
        "finished": datetime.now(UTC).isoformat(),
        "settings": settings,
        "environment": environment(),
        "sections": [
            {
                **asdict(section),
                "passed": section.passed,
                "checks": [{**asdict(c), "passed": c.passed} for c in section.checks],
            }
            for section in sections
        ],
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path
