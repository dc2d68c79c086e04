"""What sealing stored responses costs (``IDEMPOTENCY_ENCRYPTION_KEYS``): the testproject's
receipts of 1 KiB and 1 MiB, unprotected, fresh and replayed, with and without keys.

In-process through Django's test client (no HTTP server, so the unprotected request is cheaper
than over a socket and the ratios err high), on the benchmark database. The modes are
interleaved request by request in a shuffled order, the setting switched between requests
outside the timing, so that drift in the machine's load hits them alike. Ratios are medians
over the unprotected receipt of the same size.
"""

from __future__ import annotations

import base64
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections import defaultdict
from typing import TYPE_CHECKING

from bench.report import Check, Section
from bench.server import ROOT, django_env

if TYPE_CHECKING:
    from bench.run import Options

TOKEN = "a" * 40  # the demo user alice's public token (seed_demo)
SIZES = {"1 KiB": 1024, "1 MiB": 1024 * 1024}
PLAIN, FRESH, REPLAY = "plain", "fresh key", "replay"
SEALED = ", sealed"
KINDS = (PLAIN, FRESH, FRESH + SEALED, REPLAY, REPLAY + SEALED)
# The target of the issue: sealing adds at most this to the ratio of a 1 KiB receipt.
TARGET = 0.05


def setup_django(url: str) -> None:
    os.environ.update(django_env(url))
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def run(options: Options) -> Section:
    setup_django(options.database_url)
    from django.conf import settings
    from django.test import Client

    key = base64.b64encode(os.urandom(32)).decode()
    client = Client(HTTP_AUTHORIZATION=f"Token {TOKEN}", SERVER_NAME="localhost")
    rng = random.Random(options.seed)
    stored: dict[tuple[str, bool], str] = {}

    def send(kind: str, label: str) -> float:
        sealed = kind.endswith(SEALED)
        settings.IDEMPOTENCY_ENCRYPTION_KEYS = [key] if sealed else []
        body = json.dumps({"amount": 2499, "currency": "inr", "size": SIZES[label]})
        headers: dict[str, str] = {}
        path = "/api/receipts/"
        if kind == PLAIN:
            path = "/api/receipts-plain/"
        elif kind.startswith(FRESH):
            headers["Idempotency-Key"] = str(uuid.uuid4())
        else:
            headers["Idempotency-Key"] = stored[(label, sealed)]
        started = time.perf_counter()
        response = client.post(path, body, content_type="application/json", headers=headers)
        elapsed = time.perf_counter() - started
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        if response.status_code != 201 or replayed != kind.startswith(REPLAY):
            raise RuntimeError(f"{kind} {label}: {response.status_code} {response.content[:200]!r}")
        return elapsed

    for label in SIZES:
        for sealed in (False, True):
            stored[(label, sealed)] = str(uuid.uuid4())
            send(FRESH + (SEALED if sealed else ""), label)  # warm the path
            settings.IDEMPOTENCY_ENCRYPTION_KEYS = [key] if sealed else []
            client.post(
                "/api/receipts/",
                json.dumps({"amount": 2499, "currency": "inr", "size": SIZES[label]}),
                content_type="application/json",
                headers={"Idempotency-Key": stored[(label, sealed)]},
            )
    samples: defaultdict[tuple[str, str], list[float]] = defaultdict(list)
    rounds = {"1 KiB": options.requests, "1 MiB": max(10, options.requests // 10)}
    load = os.getloadavg()
    for label, count in rounds.items():
        cells = [(kind, label) for kind in KINDS]
        for kind, _ in cells:  # warm-up
            send(kind, label)
        for _ in range(count):
            rng.shuffle(cells)
            for kind, size in cells:
                samples[(kind, size)].append(send(kind, size))
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = []
    medians = {cell: statistics.median(values) for cell, values in samples.items()}
    rows = []
    checks = []
    for label in SIZES:
        plain = medians[(PLAIN, label)]
        ratio = {kind: medians[(kind, label)] / plain for kind in KINDS}
        for kind in KINDS:
            rows.append(
                [
                    label,
                    kind,
                    f"{medians[(kind, label)] * 1000:.3f}",
                    f"{ratio[kind]:.2f}x",
                    str(len(samples[(kind, label)])),
                ]
            )
        for base in (FRESH, REPLAY):
            added = ratio[base + SEALED] - ratio[base]
            checks.append(
                Check(
                    f"{base}, sealed - {base}, {label}",
                    added,
                    TARGET if label == "1 KiB" else 10.0,
                    at_most=True,
                    note="of the unprotected receipt"
                    + ("" if label == "1 KiB" else "; no target, for the record"),
                )
            )
    return Section(
        title="Sealing stored responses (in-process, Django's test client)",
        header=["size", "mode", "median ms", "ratio", "requests"],
        rows=rows,
        checks=checks,
        notes=[f"load average at start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"],
        data={
            "samples_ms": {
                f"{kind} {label}": [v * 1000 for v in values]
                for (kind, label), values in samples.items()
            },
            "load_average": load,
        },
    )
