"""zstd against zlib for stored bodies (``IDEMPOTENCY_BODY_COMPRESSION``): the testproject's
receipts of 1 KiB, 64 KiB and 1 MiB, stored (a fresh key) and replayed, sealed and not.

In-process through Django's test client, on the benchmark database, as
``bench/sealing_bench.py`` does; the app compresses every body here (``database_compresses``
is turned off, as on a server without lz4, and a sealed body is always compressed in the app).
Codecs and modes are interleaved request by request in a shuffled order, the settings switched
between requests outside the timing. Ratios are zstd's median over zlib's for the same cell;
"stored" is the body column's length. A second table times the codecs alone on the same
receipts (this process's CPU, median of repeated runs): the part of a request that the
setting changes, which a busy machine's noise in whole requests can hide; its ratios are
the checks.
"""

from __future__ import annotations

import base64
import json
import os
import random
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from bench.report import Check, Section
from bench.sealing_bench import TOKEN, setup_django

if TYPE_CHECKING:
    from bench.run import Options

SIZES = {"1 KiB": 1024, "64 KiB": 64 * 1024, "1 MiB": 1024 * 1024}
CODECS = ("zlib", "zstd")
FRESH, REPLAY = "store", "replay"
# zstd must not be slower than zlib level 1 where it matters (the large bodies).
TARGET = 1.0


def run(options: Options) -> Section:
    setup_django(options.database_url)
    from django.conf import settings
    from django.test import Client

    from django_idempotency.models import IdempotencyRecord
    from django_idempotency.storage import bodies

    # As on a server without lz4; put back at the end, for the benchmarks run after this one.
    database_compresses = bodies.database_compresses
    bodies.database_compresses = lambda using: False  # type: ignore[assignment]
    key = base64.b64encode(os.urandom(32)).decode()
    client = Client(HTTP_AUTHORIZATION=f"Token {TOKEN}", SERVER_NAME="localhost")
    rng = random.Random(options.seed)
    stored: dict[tuple[str, str, bool], str] = {}

    def configure(codec: str, sealed: bool) -> None:
        settings.IDEMPOTENCY_BODY_COMPRESSION = codec
        settings.IDEMPOTENCY_ENCRYPTION_KEYS = [key] if sealed else []

    receipts: dict[str, bytes] = {}

    def send(mode: str, label: str, codec: str, sealed: bool, idem: str | None = None) -> float:
        configure(codec, sealed)
        body = json.dumps({"amount": 2499, "currency": "inr", "size": SIZES[label]})
        idem = idem or (stored[(label, codec, sealed)] if mode == REPLAY else str(uuid.uuid4()))
        started = time.perf_counter()
        response = client.post(
            "/api/receipts/",
            body,
            content_type="application/json",
            headers={"Idempotency-Key": idem},
        )
        elapsed = time.perf_counter() - started
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        if response.status_code != 201 or replayed != (mode == REPLAY):
            raise RuntimeError(f"{mode} {label}: {response.status_code} {response.content[:200]!r}")
        receipts[label] = response.content
        return elapsed

    sizes: dict[tuple[str, str, bool], int] = {}
    for label in SIZES:
        for codec in CODECS:
            for sealed in (False, True):
                idem = stored[(label, codec, sealed)] = str(uuid.uuid4())
                send(FRESH, label, codec, sealed, idem)
                record = IdempotencyRecord.objects.get(key=idem)
                sizes[(label, codec, sealed)] = len(record.response_body or b"")
    samples: defaultdict[tuple[str, str, str, bool], list[float]] = defaultdict(list)
    rounds = {
        "1 KiB": options.requests,
        "64 KiB": max(20, options.requests // 4),
        "1 MiB": max(10, options.requests // 20),
    }
    load = os.getloadavg()
    for label, count in rounds.items():
        cells = [(m, c, s) for m in (FRESH, REPLAY) for c in CODECS for s in (False, True)]
        for mode, codec, sealed in cells:  # warm-up
            send(mode, label, codec, sealed)
        for _ in range(count):
            rng.shuffle(cells)
            for mode, codec, sealed in cells:
                samples[(label, mode, codec, sealed)].append(send(mode, label, codec, sealed))
    configure("zlib", False)
    del settings.IDEMPOTENCY_BODY_COMPRESSION
    bodies.database_compresses = database_compresses  # type: ignore[assignment]
    medians = {cell: statistics.median(values) for cell, values in samples.items()}
    rows, checks = [], []
    for label in SIZES:
        for sealed in (False, True):
            for mode in (FRESH, REPLAY):
                zlib_ms, zstd_ms = (medians[(label, mode, c, sealed)] * 1000 for c in CODECS)
                ratio = zstd_ms / zlib_ms
                rows.append(
                    [
                        label,
                        "sealed" if sealed else "plain",
                        mode,
                        f"{zlib_ms:.3f}",
                        f"{zstd_ms:.3f}",
                        f"{ratio:.2f}x",
                        f"{sizes[(label, 'zlib', sealed)]:,}",
                        f"{sizes[(label, 'zstd', sealed)]:,}",
                    ]
                )

    codec_rows, codec_ms = [], {}
    for label in ("64 KiB", "1 MiB"):  # 1 KiB is below IDEMPOTENCY_COMPRESS_MIN_BYTES
        receipt = receipts[label]
        for codec in CODECS:
            stored_body, _ = bodies.encode_body("default", receipt, 0, sealed=True, codec=codec)
            compress = _cpu_ms(
                partial(bodies.encode_body, "default", receipt, 0, sealed=True, codec=codec)
            )
            decompress = _cpu_ms(partial(bodies.decode_body, stored_body, codec))
            codec_ms[(label, codec)] = (compress, decompress)
            codec_rows.append(
                [label, codec, f"{compress:.3f}", f"{decompress:.3f}", f"{len(stored_body):,}"]
            )
        for index, step in enumerate(("compress", "decompress")):
            zlib_ms, zstd_ms = (codec_ms[(label, c)][index] for c in CODECS)
            checks.append(
                Check(f"zstd / zlib, {step}, {label}", zstd_ms / zlib_ms, TARGET, at_most=True)
            )
    return Section(
        title="zstd against zlib for stored bodies (in-process, Django's test client)",
        header=["size", "stored", "mode", "zlib ms", "zstd ms", "zstd/zlib", "zlib B", "zstd B"],
        rows=rows,
        checks=checks,
        tables=[
            (
                "The codecs alone, on the same receipts (CPU ms, median)",
                ["size", "codec", "compress", "decompress", "bytes"],
                codec_rows,
            )
        ],
        notes=[
            f"load average at start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}",
            "1 KiB is below IDEMPOTENCY_COMPRESS_MIN_BYTES (2048): stored as sent either way",
        ],
        data={
            "samples_ms": {
                f"{label} {mode} {codec}{' sealed' if sealed else ''}": [v * 1000 for v in values]
                for (label, mode, codec, sealed), values in samples.items()
            },
            "stored_bytes": {
                f"{label} {codec}{' sealed' if sealed else ''}": size
                for (label, codec, sealed), size in sizes.items()
            },
            "load_average": load,
        },
    )


def _cpu_ms(step: Callable[[], object], repeats: int = 15) -> float:
    """The median CPU time of ``step``, in ms, each sample long enough for the clock."""
    samples = []
    for _ in range(repeats):
        loops, started = 0, time.process_time()
        while (elapsed := time.process_time() - started) < 0.02:
            step()
            loops += 1
        samples.append(elapsed / loops * 1000)
    return statistics.median(samples)
