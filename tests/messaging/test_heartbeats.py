"""The relays' heartbeats: a running relay beats every few seconds (not per message), with
what it published and its last error, even while its broker is down; a clean stop removes
its row; ``manage.py idempotency_outbox status`` shows them and fails when messages wait and
no relay beats."""

from __future__ import annotations

import os
import shutil
import socket
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest

pytest.importorskip("celery")
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.utils import timezone

from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.messaging.relay import heartbeats
from django_idempotency.messaging.relay import loop as relay_module
from django_idempotency.messaging.relay.heartbeats import Heartbeat
from django_idempotency.messaging.relay.loop import Relay
from django_idempotency.models import RelayHeartbeat
from tests.messaging.test_relay import make_app
from tests.support.chain_processes import RedisServer, wait_for
from tests.support.relays import running
from tests.support.servers import free_port


@pytest.fixture
def quick_beats(monkeypatch: pytest.MonkeyPatch) -> float:
    every = 0.2
    monkeypatch.setattr(heartbeats, "BEAT_EVERY", every)
    monkeypatch.setattr(relay_module, "BEAT_EVERY", every)
    return every


def enqueue(count: int) -> None:
    with transaction.atomic():
        for n in range(count):
            enqueue_task("tests.relay.record", (n,))


def beat_row(owner: str) -> RelayHeartbeat | None:
    return RelayHeartbeat.objects.filter(owner=owner).first()


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_a_running_relay_beats_with_its_figures_and_a_clean_stop_removes_its_row(
    private_redis: RedisServer, quick_beats: float
) -> None:
    relay = Relay(app=make_app(private_redis.url))
    with running(relay):
        first = wait_for(lambda: beat_row(relay.owner), timeout=30)
        assert (first.host, first.pid) == (socket.gethostname(), os.getpid())
        assert first.published == 0 and first.failed == 0
        enqueue(3)
        beaten = wait_for(
            lambda: (row := beat_row(relay.owner)) and row.published == 3 and row, timeout=30
        )
        assert beaten.beat_at > first.beat_at and beaten.started_at == first.started_at
        # Idle, it goes on beating.
        wait_for(lambda: beat_row(relay.owner).beat_at > beaten.beat_at, timeout=30)  # type: ignore[union-attr]
    assert beat_row(relay.owner) is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_a_relay_whose_broker_is_down_beats_with_its_last_error(quick_beats: float) -> None:
    enqueue(1)
    relay = Relay(app=make_app(f"redis://127.0.0.1:{free_port()}/0"))  # nobody listens there
    with running(relay):
        row = wait_for(lambda: (r := beat_row(relay.owner)) and r.failed >= 2 and r, timeout=60)
    assert row.published == 0
    assert "Error" in row.last_error


@pytest.mark.django_db
def test_beats_are_written_at_most_every_few_seconds_unless_forced() -> None:
    heartbeat = Heartbeat("default", "relay-a", timezone.now())
    assert heartbeat.beat()
    written = RelayHeartbeat.objects.get().beat_at
    heartbeat.count(published=40, failed=0, error="")
    assert not heartbeat.beat()  # within BEAT_EVERY: nothing written
    assert RelayHeartbeat.objects.get().published == 0
    assert heartbeat.beat(force=True)
    row = RelayHeartbeat.objects.get()
    assert row.published == 40 and row.beat_at >= written


@pytest.mark.django_db
def test_a_starting_relay_forgets_rows_dead_for_a_day_and_keeps_recent_stale_ones() -> None:
    now = timezone.now()
    for owner, beat in (("long-dead", timedelta(days=2)), ("just-dead", timedelta(minutes=5))):
        RelayHeartbeat.objects.create(
            owner=owner, host="h", pid=1, started_at=now - beat, beat_at=now - beat
        )
    Heartbeat("default", "new", now).start()
    assert sorted(RelayHeartbeat.objects.values_list("owner", flat=True)) == ["just-dead", "new"]


def status() -> str:
    out = StringIO()
    call_command("idempotency_outbox", "status", stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_status_with_nothing_waiting_passes_without_a_relay() -> None:
    text = status()
    assert "Backlog: 0 messages waiting" in text
    assert "Dead letters: 0." in text
    assert "Relays: none has a heartbeat." in text


@pytest.mark.django_db
def test_status_fails_when_messages_wait_and_no_relay_beat_lately() -> None:
    enqueue(2)
    stale = timezone.now() - heartbeats.STALE_AFTER - timedelta(seconds=5)
    RelayHeartbeat.objects.create(
        owner="gone:1:ab", host="web-1", pid=4242, started_at=stale, beat_at=stale
    )
    with pytest.raises(CommandError) as failed:
        status()
    message = str(failed.value)
    assert "2 messages wait and no relay has beaten in the last 30 s" in message
    assert "manage.py idempotency_relay" in message


@pytest.mark.django_db
def test_status_lists_each_relay_with_its_last_beat_and_passes_while_one_beats() -> None:
    enqueue(1)
    now = timezone.now()
    RelayHeartbeat.objects.create(
        owner="web-1:7:aa", host="web-1", pid=7, started_at=now - timedelta(hours=1),
        beat_at=now - timedelta(seconds=2), published=120, failed=1, last_error="Boom: gone",
    )  # fmt: skip
    RelayHeartbeat.objects.create(
        owner="web-2:8:bb", host="web-2", pid=8, started_at=now - timedelta(hours=2),
        beat_at=now - timedelta(minutes=3),
    )  # fmt: skip
    text = status()
    assert "Backlog: 1 messages waiting to be published, the oldest" in text
    first, second = (line for line in text.splitlines() if line.startswith("Relay "))
    assert first.startswith("Relay web-1:7:aa on web-1, pid 7: last beat 2 s ago, started")
    assert "120 published, 1 failed publishes, last error: Boom: gone." in first
    assert second.startswith("Relay web-2:8:bb on web-2, pid 8: last beat 180 s ago (stale")


def test_age_and_alive_read_the_last_beat(settings: Any) -> None:
    now = timezone.now()
    row = RelayHeartbeat(owner="x", host="h", pid=1, started_at=now, beat_at=now)
    assert heartbeats.age(row, now + timedelta(seconds=12)) == 12
    assert heartbeats.age(row, now - timedelta(seconds=1)) == 0  # clocks a little apart
    assert heartbeats.alive(row, now + heartbeats.STALE_AFTER)
    assert not heartbeats.alive(row, now + heartbeats.STALE_AFTER + timedelta(seconds=1))


@pytest.mark.django_db
def test_the_old_backlog_check_says_whether_a_relay_beats(settings: Any) -> None:
    from django.db import connection

    from django_idempotency.checks import check_outbox_backlog

    settings.IDEMPOTENCY_OUTBOX_MAX_AGE = timedelta(minutes=5)
    enqueue(1)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE django_idempotency_outbox SET created_at = now() - interval '10 minutes'"
        )
    (warning,) = check_outbox_backlog(None, databases=["default"])
    assert warning.id == "django_idempotency.W120"
    assert "no relay has beaten in the last 30 s (none runs, or it hangs)." in warning.msg
    now = timezone.now()
    RelayHeartbeat.objects.create(
        owner="web-1:7:aa", host="web-1", pid=7, started_at=now, beat_at=now,
        last_error="OperationalError: refused",
    )  # fmt: skip
    (warning,) = check_outbox_backlog(None, databases=["default"])
    assert "relay web-1:7:aa on web-1 runs (last beat " in warning.msg
    assert " s ago) but does not keep up, or cannot reach its destination" in warning.msg
    assert "(its last error: OperationalError: refused)." in warning.msg
