"""The benchmark's settings (``bench.settings``) with ``IDEMPOTENCY_LOOKUP_FIRST``: the
request benchmark runs a second gunicorn with these, to measure the lock-free lookup against
the claim."""

from __future__ import annotations

from bench.settings import *  # noqa: F403

IDEMPOTENCY_LOOKUP_FIRST = True
