"""``python -m tests.reliability --profile short|long|pgbouncer|chain|chain-short``; a chain
profile with ``--destination celery-redis|celery-rabbitmq|nats|nats-cluster|tasks-rq``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from tests.reliability.chain_destinations import DESTINATIONS
from tests.reliability.postgres import explicit_server_url
from tests.reliability.profiles import PROFILES
from tests.reliability.run import run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument(
        "--report",
        type=Path,
        help="Write the report here (Markdown) and next to it with .json "
        "(default: a file in the temporary directory).",
    )
    parser.add_argument(
        "--database-url",
        default=explicit_server_url(),
        help="A PostgreSQL server to create the run's database on; it is never restarted "
        "(default: DATABASE_URL if set, else a private embedded cluster).",
    )
    parser.add_argument(
        "--destination",
        choices=sorted(DESTINATIONS),
        help="Where a chain profile's relays publish and what consumes it (default: celery-redis).",
    )
    parser.add_argument("--seed", type=int, help="Seed of the clients' and faults' choices.")
    parser.add_argument(
        "--minutes", type=float, help="Minutes of faulted traffic, instead of the profile's."
    )
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    name = args.profile
    if args.destination:
        if profile.chain is None:
            parser.error(f"--destination is for a chain profile (chain, chain-short), not {name}")
        destination = DESTINATIONS[args.destination]
        missing = destination.missing()
        if missing:
            parser.error(f"--destination {args.destination} needs {missing}")
        chain = dataclasses.replace(profile.chain, destination=args.destination)
        profile = dataclasses.replace(profile, chain=chain)
        name = f"{name}-{args.destination}"
    report = run(
        profile,
        server_url=args.database_url,
        seed=args.seed,
        traffic_seconds=args.minutes * 60 if args.minutes else None,
    )
    path = args.report or Path(tempfile.gettempdir()) / (
        f"idempotency-reliability-{name}-{time.strftime('%Y%m%d-%H%M%S')}.md"
    )
    markdown, data = report.write(path)
    print(report.to_markdown())
    print(f"Report: {markdown} and {data}", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
