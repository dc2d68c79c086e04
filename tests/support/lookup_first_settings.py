"""The test settings with ``IDEMPOTENCY_LOOKUP_FIRST``: a live server whose protected views
look a key's record up without a lock before claiming it."""

from __future__ import annotations

from tests.settings import *  # noqa: F403

IDEMPOTENCY_LOOKUP_FIRST = True
