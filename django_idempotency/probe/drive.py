"""The probe's client side: it asks each app server for its facts, sends concurrent
duplicates of one probe key across them, and marks each line against the contract."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from django_idempotency.probe.facts import Fact, Verdict

REPLAYED_HEADER = "Idempotent-Replayed"


@dataclass(frozen=True)
class Answer:
    status: int
    replayed: bool
    body: bytes

    def problem(self) -> str:
        try:
            document = json.loads(self.body)
        except ValueError:
            return self.body[:120].decode("utf-8", "replace")
        return str(document.get("type") or document.get("detail") or document)


@dataclass
class Report:
    lines: list[tuple[str, Fact]] = field(default_factory=list)

    def add(self, where: str, fact: Fact) -> None:
        self.lines.append((where, fact))

    @property
    def passed(self) -> bool:
        return all(fact.verdict != "fail" for _, fact in self.lines)

    def text(self) -> str:
        rows = []
        for where, fact in self.lines:
            detail = f" ({fact.detail})" if fact.detail else ""
            rows.append(f"{fact.verdict.upper():4}  {where}  {fact.name}: {fact.value}{detail}")
        rows.append("probe: " + ("passed" if self.passed else "FAILED"))
        return "\n".join(rows)

    def as_json(self) -> str:
        lines = [{"where": where, **asdict(fact)} for where, fact in self.lines]
        return json.dumps({"passed": self.passed, "lines": lines}, indent=2)


def _request(
    url: str, token: str, *, key: str | None = None, timeout: float
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {token}", "Connection": "close"}
    data = None
    if key is not None:
        headers |= {"Idempotency-Key": key, "Content-Type": "application/json"}
        data = json.dumps({"probe": key}).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def probe(
    urls: Sequence[str],
    token: str,
    *,
    duplicates: int = 16,
    timeout: float = 30.0,
    endpoints: Sequence[str] = (),
    credentials: dict[str, str] | None = None,
) -> Report:
    """Probe the app servers at ``urls`` (each the base URL the probe is mounted at), and
    the project's own protected ``endpoints`` (paths on the same servers) as a client with
    ``credentials`` (headers)."""
    report = Report()
    bases = [url.rstrip("/") + "/" for url in urls]
    secrets = {}
    for base in bases:
        try:
            status, _, body = _request(base + "report/", token, timeout=timeout)
        except OSError as exc:
            report.add(base, Fact("reached", "fail", "no answer", str(exc)))
            continue
        if status != 200:
            report.add(base, Fact("reached", "fail", f"HTTP {status}", body[:200].decode()))
            continue
        document = json.loads(body)
        for fact in document["facts"]:
            report.add(base, Fact(**fact))
        secrets[base] = next(f["value"] for f in document["facts"] if f["name"] == "lock secret")
    if len(set(secrets.values())) > 1:
        report.add(
            "all",
            Fact(
                "one lock secret",
                "fail",
                ", ".join(f"{base}: {value}" for base, value in secrets.items()),
                "the servers declare different secrets: those whose IDEMPOTENCY_SECRET_KEY "
                "is not the database's refuse every keyed request (500 misconfigured); "
                "remove IDEMPOTENCY_SECRET_KEY everywhere (the database's shared secret)",
            ),
        )
    elif secrets:
        report.add("all", Fact("one lock secret", "pass", next(iter(secrets.values()))))
    _duplicates(report, bases, token, duplicates, timeout)
    for path in endpoints:
        for base in bases:
            report.add(base, _endpoint(base, path, token, credentials or {}, timeout))
    return report


def _endpoint(
    base: str, path: str, token: str, credentials: dict[str, str], timeout: float
) -> Fact:
    """One of the project's views, asked with the probe header: its checks run (the key,
    the principal, the order of authentication and claim) and the view does not."""
    parts = urllib.parse.urlsplit(base)
    url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
    headers = {
        **credentials,
        "Idempotency-Key": f"probe-{uuid.uuid4()}",
        "Idempotency-Probe": token,
        "Content-Type": "application/json",
        "Connection": "close",
    }
    request = urllib.request.Request(url, data=b"{}", headers=headers)
    name = f"endpoint {path}"
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, body = response.status, b""
            probed = response.headers.get("Idempotency-Probe")
            principal = response.headers.get("Idempotency-Probe-Principal")
    except urllib.error.HTTPError as error:
        status, probed, principal, body = error.code, None, None, error.read()
    except OSError as exc:
        return Fact(name, "fail", "no answer", str(exc))
    if status == 204 and probed == "passed":
        if principal == "anonymous" and credentials:
            return Fact(
                name,
                "fail",
                "claimed as anonymous",
                f"the probe sent credentials ({', '.join(sorted(credentials))}), yet the key "
                "is claimed under the anonymous principal, shared by every client of this "
                "view (allow_anonymous=True): authenticate before the claim (@idempotent "
                "below the view's authentication), or give the view a principal callable",
            )
        if principal == "anonymous":
            return Fact(name, "pass", "checks passed", "anonymous keys, as the view allows")
        return Fact(name, "pass", "checks passed", "the key is claimed after authentication")
    answer = Answer(status, False, body)
    detail = answer.problem()
    if "misconfigured" in detail:
        detail += (
            ": the key is claimed for an anonymous client (the server's error log names the "
            "view): is @idempotent above the view's own authentication (put it below, "
            "docs/view-styles.md), or does the view need a principal callable?"
        )
    elif "reused" in detail:
        detail += ": the key is stored for another request"
    elif status in (401, 403):
        detail = "the credentials were refused: pass the headers of a real client (--header)"
    elif status == 405:
        detail = "the view refused the probe's POST"
    return Fact(name, "fail", f"HTTP {status}", detail)


def _duplicates(
    report: Report, bases: list[str], token: str, duplicates: int, timeout: float
) -> None:
    key = f"probe-{uuid.uuid4()}"
    barrier = threading.Barrier(duplicates)

    def send(n: int) -> Answer:
        barrier.wait(timeout=timeout)
        try:
            status, headers, body = _request(bases[n % len(bases)] + "run/", token, key=key,
                                             timeout=timeout)  # fmt: skip
        except OSError as exc:
            return Answer(0, False, str(exc).encode())
        return Answer(status, headers.get(REPLAYED_HEADER) == "true", body)

    with ThreadPoolExecutor(duplicates) as pool:
        answers = list(pool.map(send, range(duplicates)))
    where = f"{duplicates} duplicates across {len(bases)} server(s)"
    statuses = Counter(
        f"{a.status}{' replayed' if a.replayed else ''}" for a in answers
    ).most_common()
    summary = ", ".join(f"{count} x {status}" for status, count in statuses)
    executed = [a for a in answers if a.status == 201 and not a.replayed]
    refused = sorted({a.problem() for a in answers if a.status >= 500 or a.status == 0})
    if refused:
        report.add(where, Fact("answers", "fail", summary, "; ".join(refused)))
    if not refused:
        first = executed[0].body if len(executed) == 1 else None
        # Every other answer is a replay of the one execution, or 409 in progress.
        kept = all(
            a.status == 409 or (a.replayed and a.body == first)
            for a in answers
            if a not in executed
        )
        verdict: Verdict = "pass" if first is not None and kept else "fail"
        report.add(where, Fact("answers", verdict, summary, "one execution, replays or 409"))
    counted = _executions(bases[0], token, key, timeout)
    report.add(
        where,
        Fact(
            "executions in the database",
            "pass" if counted == 1 else "fail",
            str(counted),
            "the probe rows its key wrote, counted after the duplicates",
        ),
    )


def _executions(base: str, token: str, key: str, timeout: float) -> int | str:
    query = urllib.parse.urlencode({"key": key})
    try:
        status, _, body = _request(f"{base}report/?{query}", token, timeout=timeout)
    except OSError as exc:
        return f"unknown ({exc})"
    document: dict[str, Any] = json.loads(body) if status == 200 else {}
    count = document.get("executions")
    return count if isinstance(count, int) else f"unknown (HTTP {status})"
