"""Where a request's CPU time goes, per mode: ``python -m bench.request_profile``.

The request benchmark's three modes through Django's test client in this process (no HTTP
server), interleaved. For each mode: the thread's CPU time per request, and the inclusive
CPU time of the functions listed in PROBES (the library's request path, the testproject's
handler, authentication, commits, every query). Thread CPU time leaves out waiting for the
database and time the OS gave to other processes, so it is steady on a busy machine.
Probes the code no longer has are reported as missing rather than failing.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import random
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from bench.request_bench import BODY, FRESH, MODES, PATHS, PLAIN, REPLAY, TOKEN
from bench.server import database_url, django_env, prepare

# (module, attribute path, label); indentation in a label shows what runs inside what.
PROBES = [
    ("rest_framework.authentication", "TokenAuthentication.authenticate", "token authentication"),
    ("testproject.payments.views", "create_payment", "charge handler (serializer, INSERT)"),
    ("django_idempotency.rest_framework", "IdempotencyMixin.initial", "mixin.initial"),
    ("django_idempotency.rest_framework", "policy_for", "  options.policy_for"),
    ("django_idempotency.http.request", "RequestUnit.open", "  RequestUnit.open"),
    ("django_idempotency.http.request", "parse_key", "    parse_key"),
    ("django_idempotency.http.request", "principal_for", "    principal_for"),
    ("django_idempotency.http.request", "fingerprint", "    fingerprint"),
    ("django_idempotency.engine.unit", "UnitOfWork.open", "    UnitOfWork.open"),
    ("django_idempotency.storage.records", "lookup", "      storage.lookup"),
    ("django_idempotency.storage.records", "claim", "      storage.claim"),
    ("django_idempotency.http.request", "replay_response", "  replay_response"),
    ("django_idempotency.http.request", "RequestUnit.close", "RequestUnit.close"),
    ("django_idempotency.http.request", "_result", "  _result (render, headers)"),
    ("django_idempotency.engine.unit", "UnitOfWork.close", "  UnitOfWork.close"),
    ("django_idempotency.storage.bodies", "encode_body", "    bodies.encode_body"),
    ("django_idempotency.storage.records", "store", "    storage.store (+COMMIT)"),
    ("django.db.transaction", "Atomic.__exit__", "atomic exit (COMMIT)"),
    ("django.db.backends.utils", "CursorWrapper.execute", "every cursor.execute"),
]

cpu_used: defaultdict[str, float] = defaultdict(float)
calls: Counter[str] = Counter()


def _timed(func: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return func(*args, **kwargs)
        finally:
            cpu_used[label] += time.thread_time() - started
            calls[label] += 1

    return wrapper


def install_probes() -> list[str]:
    """Wrap every probe that exists; return the labels of those that do not."""
    missing = []
    for module_name, path, label in PROBES:
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        try:
            for parent in parents:
                owner = getattr(owner, parent)
            raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        except (AttributeError, KeyError):
            missing.append(label)
            continue
        if isinstance(raw, classmethod | staticmethod):
            setattr(owner, name, type(raw)(_timed(raw.__func__, label)))
        else:
            setattr(owner, name, _timed(raw, label))
    return missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.request_profile", description=__doc__)
    p.add_argument("--requests", type=int, default=300, help="requests per mode (default 300)")
    p.add_argument("--database-url", help="as for python -m bench")
    args = p.parse_args(argv)

    url = database_url(args.database_url)
    prepare(url)
    os.environ.update(django_env(url))
    import django

    django.setup()
    from django.test import Client

    missing = install_probes()
    client = Client(SERVER_NAME="127.0.0.1")
    auth = {"Authorization": f"Token {TOKEN}"}
    keys: list[str] = []
    rng = random.Random(1)

    def send(mode: str) -> None:
        headers = dict(auth)
        if mode == FRESH:
            keys.append(str(uuid.uuid4()))
            headers["Idempotency-Key"] = keys[-1]
        elif mode == REPLAY:
            headers["Idempotency-Key"] = rng.choice(keys)
        response = client.post(PATHS[mode], BODY, content_type="application/json", headers=headers)
        if response.status_code != 201:
            raise SystemExit(f"{mode}: {response.status_code} {response.content[:300]!r}")

    send(FRESH)
    for _ in range(50):
        for mode in MODES:
            send(mode)
    total: defaultdict[str, float] = defaultdict(float)
    per_mode: dict[str, dict[str, float]] = {m: defaultdict(float) for m in MODES}
    per_mode_calls: dict[str, Counter[str]] = {m: Counter() for m in MODES}
    order = list(MODES)
    for _ in range(args.requests):
        rng.shuffle(order)
        for mode in order:
            cpu_used.clear()
            calls.clear()
            started = time.thread_time()
            send(mode)
            total[mode] += time.thread_time() - started
            for label, seconds in cpu_used.items():
                per_mode[mode][label] += seconds
            per_mode_calls[mode].update(calls)

    n = args.requests

    def us(seconds: float) -> str:
        return f"{seconds / n * 1e6:7.0f}"

    print(f"CPU us per request, {n} requests per mode, modes interleaved (thread CPU time)")
    print(f"{'':40} " + " ".join(f"{m:>9}" for m in MODES) + "   calls per request")
    print(f"{'whole request':40} " + " ".join(f"{us(total[m]):>9}" for m in MODES))
    for _, _, label in PROBES:
        if label in missing:
            print(f"{label:40} (not found)")
            continue
        cells = " ".join(f"{us(per_mode[m][label]):>9}" for m in MODES)
        counts = "/".join(f"{per_mode_calls[m][label] / n:.0f}" for m in MODES)
        print(f"{label:40} {cells}   {counts}")
    overhead = {m: (total[m] - total[PLAIN]) / total[PLAIN] for m in MODES}
    print(
        f"fresh key / plain = {1 + overhead[FRESH]:.2f}x, replay / plain = "
        f"{1 + overhead[REPLAY]:.2f}x (CPU of this process only: no HTTP server, no database)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
