"""The testproject's settings for the waiting-duplicate flood's server: fewer duplicates
may wait per process than it has threads (``RELIABILITY_MAX_WAITERS``), so waiting
duplicates never take them all."""

from __future__ import annotations

import os
from datetime import timedelta

from testproject.settings import *  # noqa: F403

IDEMPOTENCY_MAX_WAITERS = int(os.environ.get("RELIABILITY_MAX_WAITERS", "2"))

# Waiting is opt-in: the flood's duplicates may wait (their Prefer: wait=10 is honoured).
IDEMPOTENCY_WAIT = timedelta(seconds=2)
