"""The curl transcripts of docs/quickstart.md, read as a person would type them; every one
is sent, in order, to the demo as it runs by
``tests/project/test_testproject.py::test_demo_serves_the_api_the_quickstart_transcripts_and_its_styled_admin_until_stopped``,
which compares the documented status, headers and body fields. The README's own curl lines
are the demo's, which ``manage.py demo --smoke`` sends (the smoke test there)."""

from __future__ import annotations

import json
import re
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "docs" / "quickstart.md"
DOCUMENTED_BASE = "http://127.0.0.1:8000"
# Fields whose values belong to one run: the charge's id, time and capture at the processor.
PER_RUN = {"id", "created", "capture"}


@dataclass
class Curl:
    method: str
    url: str
    headers: dict[str, str]
    data: str | None
    background: bool


@dataclass
class Transcript:
    commands: list[Curl]
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None


def parse_curl(line: str) -> Curl:
    words = shlex.split(line)
    background = words[-1] == "&"
    if background:
        words.pop()
    assert words[0] == "curl", line
    method, url, headers, data = "GET", "", {}, None
    rest = iter(words[1:])
    for word in rest:
        if word == "-X":
            method = next(rest)
        elif word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            data = next(rest)
        elif word == "-o":
            next(rest)
        elif word in ("-i", "-s"):
            continue
        else:
            assert not word.startswith("-"), f"unknown curl option {word} in {line}"
            url = word
    return Curl(method, url, headers, data, background)


def transcripts(text: str) -> list[Transcript]:
    found = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        lines = iter(block.splitlines())
        commands: list[Curl] = []
        status_line = ""
        for line in lines:
            if not line.startswith("$ "):
                status_line = line
                break
            while line.endswith("\\"):
                line = line[:-1] + next(lines)
            commands.append(parse_curl(line[2:]))
        assert commands and status_line.startswith("HTTP/1.1 "), block
        transcript = Transcript(commands, int(status_line.split()[1]))
        for line in lines:
            if not line:
                break
            name, _, value = line.partition(":")
            transcript.headers[name] = value.strip()
        body = "\n".join(lines).strip()
        transcript.body = json.loads(body) if body else None
        found.append(transcript)
    return found


def test_the_quickstart_transcripts_are_found() -> None:
    found = transcripts(QUICKSTART.read_text())
    assert len(found) >= 5
    assert [t.status for t in found][:3] == [201, 201, 422]
    assert 409 in [t.status for t in found]
    assert all(t.body is not None and t.headers for t in found)


def send(base: str, curl: Curl) -> requests.Response:
    assert curl.url.startswith(DOCUMENTED_BASE), curl.url
    return requests.request(
        curl.method,
        base + curl.url.removeprefix(DOCUMENTED_BASE),
        headers=curl.headers,
        data=curl.data,
        timeout=60,
    )


def runs(base: str, headers: dict[str, str]) -> int:
    """How many times the charge view has started (counted outside its transaction)."""
    answer = requests.get(f"{base}/api/charges/count/", headers=headers, timeout=30)
    answer.raise_for_status()
    return int(answer.json()["executions"])


def check_the_quickstart_transcripts(demo: str) -> None:
    """Send every transcript to the demo at ``demo``, in order, and compare each answer
    with the documented one (the demo's own test starts the demo once for this and more:
    tests/project/test_testproject.py)."""
    bodies: dict[Any, Any] = {}  # the documented charge id: the body the demo answered
    for number, transcript in enumerate(transcripts(QUICKSTART.read_text()), 1):
        running: list[threading.Thread] = []
        for curl in transcript.commands[:-1]:
            # A request left running in the background (`&`): the next one is sent once
            # its view has started, as a person typing the next line would find it.
            assert curl.background, f"transcript {number}: only the last command is shown"
            before = runs(demo, curl.headers)
            thread = threading.Thread(target=send, args=(demo, curl))
            thread.start()
            running.append(thread)
            deadline = time.monotonic() + 30
            while runs(demo, curl.headers) == before:
                assert time.monotonic() < deadline, f"transcript {number}: nothing ran"
                time.sleep(0.05)
        answer = send(demo, transcript.commands[-1])
        for thread in running:
            thread.join(timeout=60)
        where = f"transcript {number} of docs/quickstart.md"
        assert answer.status_code == transcript.status, f"{where}: {answer.text}"
        for name, value in transcript.headers.items():
            assert answer.headers.get(name) == value, f"{where}: {name}"
        body = answer.json()
        assert set(body) == set(transcript.body), where
        for name, value in transcript.body.items():
            if name not in PER_RUN:
                assert body[name] == value, f"{where}: {name}"
        if "id" in transcript.body:
            # The same documented charge is the same answered one, byte for byte; another
            # is another charge.
            documented = transcript.body["id"]
            if documented in bodies:
                assert body == bodies[documented], where
            else:
                assert body["id"] not in [b["id"] for b in bodies.values()], where
                assert str(body.get("capture", "")).startswith("cap_"), where
                bodies[documented] = body
