"""The test settings with ``IDEMPOTENCY_LOOKUP_FIRST = False``: a live server whose protected
views claim a key at once, without the lookup before the claim (the default since the lookup
became the replay's one round trip)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403

IDEMPOTENCY_LOOKUP_FIRST = False
