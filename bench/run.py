"""``python -m bench``: run the benchmarks, print their tables and ratios, keep a JSON copy.

Each benchmark is a module with ``run(options) -> Section``; add one to BENCHMARKS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

BENCHMARKS = {
    "request": "bench.request_bench",
    "claim": "bench.claim_bench",
    "partitions": "bench.partitions_bench",
    "relay": "bench.relay_bench",
    "consumer": "bench.consumer_bench",
    "sealing": "bench.sealing_bench",
    "bodies": "bench.bodies_bench",
}


@dataclass(frozen=True)
class Options:
    database_url: str
    workers: int
    clients: int
    requests: int
    warmup: int
    duration: float
    repeats: int
    preload: int
    pgbench: str | None
    seed: int
    cpus: int


def parser() -> argparse.ArgumentParser:
    cpus = os.cpu_count() or 1
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "benchmarks",
        nargs="*",
        metavar="NAME",
        help=f"which to run: {', '.join(BENCHMARKS)} (default: all)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="short runs for development; the figures are only indicative",
    )
    p.add_argument(
        "--database-url",
        help="the database to use as is (default: an idempotency_bench database "
        "on the DATABASE_URL server, else on the embedded server)",
    )
    p.add_argument(
        "--reset",
        action="store_true",
        help="drop and recreate the idempotency_bench database first",
    )
    p.add_argument("--workers", type=int, default=cpus, help="gunicorn workers (default: CPUs)")
    p.add_argument("--clients", type=int, default=8, help="parallel clients (default: 8)")
    p.add_argument("--requests", type=int, help="sequential requests per mode (default: 500)")
    p.add_argument("--duration", type=float, help="seconds per parallel cell (default: 10)")
    p.add_argument("--repeats", type=int, help="interleaved repeats of each cell (default: 3)")
    p.add_argument(
        "--preload",
        type=int,
        default=100_000,
        help="rows in each claim benchmark table before measuring (default: 100000)",
    )
    p.add_argument(
        "--pgbench", help="the pgbench binary (default: the newest one found); none: Python threads"
    )
    p.add_argument("--seed", type=int, default=1, help="random seed for the request order")
    return p


def redacted(url: str) -> str:
    """The URL without its password, fit for a results file."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    unknown = set(args.benchmarks) - set(BENCHMARKS)
    if unknown:
        p.error(
            f"unknown benchmark {', '.join(sorted(unknown))}; choose from {', '.join(BENCHMARKS)}"
        )
    # Imported late: resolving the database may start the embedded server.
    from bench import report
    from bench.server import database_url, prepare

    started = datetime.now(UTC)
    load_at_start = os.getloadavg()
    url = database_url(args.database_url, args.reset)
    quick = args.quick
    options = Options(
        database_url=url,
        workers=args.workers,
        clients=args.clients,
        requests=args.requests or (100 if quick else 500),
        warmup=20 if quick else 100,
        duration=args.duration or (2.0 if quick else 10.0),
        repeats=args.repeats or (1 if quick else 3),
        preload=min(args.preload, 10_000) if quick else args.preload,
        pgbench=args.pgbench,
        seed=args.seed,
        cpus=os.cpu_count() or 1,
    )
    prepare(url)
    sections = []
    for name in args.benchmarks or list(BENCHMARKS):
        module = importlib.import_module(BENCHMARKS[name])
        print(f"running {name} ...", file=sys.stderr, flush=True)
        section = module.run(options)
        print(report.render(section) + "\n", flush=True)
        sections.append(section)
    settings = {
        **asdict(options),
        "database_url": redacted(url),
        "quick": quick,
        "load_average_at_start": load_at_start,
    }
    path = report.save(sections, settings, started)
    failed = [s.title for s in sections if not s.passed]
    print(f"results: {path}")
    print("FAIL: " + "; ".join(failed) if failed else "all targets met")
    return 1 if failed else 0
