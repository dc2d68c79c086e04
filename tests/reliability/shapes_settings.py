"""The testproject's settings for the deployment shapes' servers (``shapes.py``): the
suite's own URLconf (``urls.py``), ``SECRET_KEY`` from ``DJANGO_SECRET_KEY`` as the
testproject reads it, and, with ``RELIABILITY_WAIT_SECONDS``, duplicates that wait for the
first (waiting is opt-in), fewer per process than it has threads
(``RELIABILITY_MAX_WAITERS``)."""

from __future__ import annotations

import os
from datetime import timedelta

from testproject.settings import *  # noqa: F403

ROOT_URLCONF = "tests.reliability.urls"

if "RELIABILITY_WAIT_SECONDS" in os.environ:
    IDEMPOTENCY_WAIT = timedelta(seconds=float(os.environ["RELIABILITY_WAIT_SECONDS"]))
    IDEMPOTENCY_MAX_WAITERS = int(os.environ.get("RELIABILITY_MAX_WAITERS", "2"))
