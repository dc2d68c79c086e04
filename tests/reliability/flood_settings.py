"""The testproject's settings for the waiting-duplicate flood's server: fewer duplicates
may wait per process than it has threads (``RELIABILITY_MAX_WAITERS``), so waiting
duplicates never take them all."""

from __future__ import annotations

import os

from testproject.settings import *  # noqa: F403

IDEMPOTENCY_MAX_WAITERS = int(os.environ.get("RELIABILITY_MAX_WAITERS", "2"))
