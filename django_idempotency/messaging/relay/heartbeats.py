"""The relays' heartbeats: each running relay keeps one row up to date every few seconds
(never per message), and removes it when it stops cleanly; operators read them
(``manage.py idempotency_outbox status``, the admin, the telemetry gauge)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from django_idempotency.models import RelayHeartbeat

# How often a running relay beats. The relay's loop wakes at least this often to do it.
BEAT_EVERY = 5.0
# A relay that has not beaten for this long is taken for dead (or hung): several beats
# missed, with room for a pass that takes a while on a busy database.
STALE_AFTER = timedelta(seconds=30)
# Rows of relays killed without a clean stop are kept this long for operators to see,
# then removed by the next relay that starts.
FORGET_AFTER = timedelta(days=1)


@dataclass
class Heartbeat:
    """One relay's heartbeat row on database ``using``, and what it counts."""

    using: str
    owner: str
    started_at: datetime
    published: int = 0
    failed: int = 0
    last_error: str = ""
    _beaten: float = -BEAT_EVERY

    def count(self, *, published: int, failed: int, error: str) -> None:
        """Add one pass's figures (in memory: written with the next beat)."""
        self.published += published
        self.failed += failed
        if error:
            self.last_error = error

    def start(self) -> None:
        """Beat at once, and forget the rows of relays that died long ago."""
        stale = timezone.now() - FORGET_AFTER
        RelayHeartbeat.objects.using(self.using).filter(beat_at__lt=stale).delete()
        self.beat(force=True)

    def beat(self, *, force: bool = False) -> bool:
        """Write the row if the last beat is ``BEAT_EVERY`` seconds old (or ``force``)."""
        now = time.monotonic()
        if not force and now - self._beaten < BEAT_EVERY:
            return False
        RelayHeartbeat.objects.using(self.using).update_or_create(
            owner=self.owner,
            defaults={
                "host": socket.gethostname()[:255],
                "pid": os.getpid(),
                "started_at": self.started_at,
                "beat_at": timezone.now(),
                "published": self.published,
                "failed": self.failed,
                "last_error": self.last_error,
            },
        )
        self._beaten = now
        return True

    def stop(self) -> None:
        """A clean stop: the relay is gone, not dead."""
        RelayHeartbeat.objects.using(self.using).filter(owner=self.owner).delete()


def relays(using: str) -> list[RelayHeartbeat]:
    """Every relay's heartbeat row, the freshest first."""
    return list(RelayHeartbeat.objects.using(using).order_by("-beat_at"))


def freshest(using: str) -> RelayHeartbeat | None:
    """The heartbeat of the relay that beat last; None when no relay has a row."""
    return RelayHeartbeat.objects.using(using).order_by("-beat_at").first()


def age(heartbeat: RelayHeartbeat, now: datetime | None = None) -> float:
    """Seconds since ``heartbeat``'s last beat (never negative)."""
    return max(0.0, ((now or timezone.now()) - heartbeat.beat_at).total_seconds())


def alive(heartbeat: RelayHeartbeat, now: datetime | None = None) -> bool:
    """Whether ``heartbeat``'s relay beat within ``STALE_AFTER``."""
    return age(heartbeat, now) <= STALE_AFTER.total_seconds()
