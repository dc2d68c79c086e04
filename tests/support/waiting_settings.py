"""The test project's settings with waiting on, as docs/deployment.md shows it: a duplicate
waits up to 2 s (``Prefer: wait`` up to 10 s), and a server process lets fewer requests wait
on a thread of their own than it has threads (``WAITING_MAX_WAITERS``, with
``WAITING_SERVER_THREADS`` as gunicorn's ``--threads``)."""

from __future__ import annotations

import os
from datetime import timedelta

from tests.settings import *  # noqa: F403

IDEMPOTENCY_WAIT = timedelta(seconds=2)
IDEMPOTENCY_MAX_WAIT = timedelta(seconds=10)
IDEMPOTENCY_MAX_WAITERS = int(os.environ.get("WAITING_MAX_WAITERS", "0"))
if os.environ.get("WAITING_SERVER_THREADS"):
    IDEMPOTENCY_SERVER_THREADS = int(os.environ["WAITING_SERVER_THREADS"])
