"""Settings of the side-effect chain's processes (``tests/scenarios/test_chain.py`` and the
reliability suite's chain profile): the test settings, with Redis redelivering a task that is still
running after 2 s (swept every second), a relay lease of 1 s and a redrive after 10 s, so
that every kind of second delivery happens within a test."""

from __future__ import annotations

from datetime import timedelta

from tests.settings import *  # noqa: F403
from tests.settings import LOGGING

CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 2,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # A worker killed while it gives messages back leaves kombu's restore lock behind: no
    # one gives anything back until it expires (300 s by default).
    "unacked_mutex_expire": 5,
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
IDEMPOTENCY_OUTBOX_LEASE = timedelta(seconds=1)
# A message the broker drops (a worker killed as it takes one: celery/kombu#305, a broker
# restarted) is published again within seconds, not the default ten minutes.
IDEMPOTENCY_OUTBOX_REDRIVE_AFTER = timedelta(seconds=10)

# When, and which process: the chain's processes log into files read after a failure.
LOGGING = {
    **LOGGING,
    "formatters": {"timed": {"format": "[%(asctime)s: %(levelname)s/%(process)d] %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "timed"}},
}
