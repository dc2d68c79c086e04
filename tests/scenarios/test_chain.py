"""The whole chain, with real processes: the payments API under gunicorn, the fake card
processor as its own HTTP service, a private redis-server, a Celery worker (prefork) and the
relay. Workers, relays and request workers are killed; each charge still has one capture at
the processor and one ledger row.

The broker runs with a 2 s visibility timeout, swept every second, so Redis redelivers a
task that runs longer than that while it is still running.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("celery")
import requests
from celery import Celery

from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.messaging.relay.loop import Relay
from django_idempotency.models import OutboxMessage
from testproject.payments.models import Charge, LedgerEntry
from testproject.payments.tasks import POST_LEDGER_ENTRY
from tests.conftest import ROOT, GunicornServer, run_gunicorn, unmeasured
from tests.support.chain_processes import (
    CHAIN_SETTINGS,
    CeleryWorker,
    RedisServer,
    processor_captures,
    processor_stats,
    run_processor,
    wait_for,
)
from tests.support.relays import running

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        __import__("shutil").which("redis-server") is None, reason="needs redis-server"
    ),
]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer.on_free_port(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def processor() -> Iterator[str]:
    with run_processor() as url:
        yield url


@pytest.fixture(scope="module")
def env(subprocess_env: dict[str, str], broker: RedisServer, processor: str) -> dict[str, str]:
    return {
        **subprocess_env,
        "CELERY_BROKER_URL": broker.url,
        "PAYMENTS_PROCESSOR_URL": processor,
        "DJANGO_SETTINGS_MODULE": CHAIN_SETTINGS,
    }


@pytest.fixture(scope="module")
def worker(env: dict[str, str], django_db_blocker: Any) -> Iterator[CeleryWorker]:
    running = CeleryWorker(env)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def web(env: dict[str, str]) -> Iterator[GunicornServer]:
    with run_gunicorn(env, workers=2) as server:
        yield server


@pytest.fixture
def relay(broker: RedisServer) -> Relay:
    app = Celery(f"chain-relay-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(broker_url=broker.url, broker_connection_retry_on_startup=True)
    return Relay(app=app)


def ledger_rows(charge_id: int | None = None) -> int:
    rows = LedgerEntry.objects.all()
    return (rows if charge_id is None else rows.filter(charge_id=charge_id)).count()


def charge_now(token_user: Any) -> Charge:
    return Charge.objects.create(amount=2499, currency="inr", user=token_user.user)


def publish(relay: Relay, charge: Charge, **switches: Any) -> str:
    """Put a ledger posting for ``charge`` in the outbox and publish it."""
    from django.db import transaction

    with transaction.atomic():
        message_id = enqueue_task(
            POST_LEDGER_ENTRY, (charge.pk, charge.amount, charge.currency), switches
        )
    assert relay.drain() == 1
    return message_id


def post_charge(web: GunicornServer, user: Any, key: str, **body: Any) -> requests.Response:
    return requests.post(
        f"{web.url}/api/charges/",
        json={"amount": 2499, "currency": "inr", **body},
        headers={**user.headers, "Idempotency-Key": key},
        timeout=30,
    )


# The worker -------------------------------------------------------------------------------


def test_a_worker_killed_mid_task_leaves_nothing_and_the_redelivery_posts_once(
    worker: CeleryWorker, relay: Relay, token_user: Any
) -> None:
    charge = charge_now(token_user)
    message_id = publish(relay, charge, crash_once=uuid.uuid4().hex)
    wait_for(lambda: ledger_rows(charge.pk), timeout=30)
    assert worker.count(f"[{message_id}] received") >= 2, worker.text()
    time.sleep(1)
    assert ledger_rows(charge.pk) == 1


def test_a_worker_killed_after_its_commit_and_before_its_ack_is_replayed_not_run_again(
    worker: CeleryWorker, relay: Relay, token_user: Any
) -> None:
    charge = charge_now(token_user)
    message_id = publish(relay, charge, crash_after_commit_once=uuid.uuid4().hex)
    # The redelivery finds the committed record and is acknowledged with its result.
    wait_for(lambda: worker.count(f"{POST_LEDGER_ENTRY}[{message_id}] already ran"), timeout=30)
    assert ledger_rows(charge.pk) == 1


def test_redis_redelivering_a_running_task_after_its_visibility_timeout_posts_once(
    worker: CeleryWorker, relay: Relay, token_user: Any
) -> None:
    charge = charge_now(token_user)
    # 5 s against a 2 s visibility timeout: Redis hands the message to the other child while
    # the first still runs; the second waits on the claim, then replays.
    message_id = publish(relay, charge, delay_ms=5000)
    wait_for(lambda: worker.count(f"{POST_LEDGER_ENTRY}[{message_id}] already ran"), timeout=40)
    assert worker.count(f"[{message_id}] received") >= 2
    assert ledger_rows(charge.pk) == 1


def test_a_relay_killed_between_publish_and_mark_publishes_twice_and_posts_once(
    worker: CeleryWorker, env: dict[str, str], token_user: Any
) -> None:
    from django.db import transaction

    from tests.messaging.test_relay import KILL_AFTER_PUBLISH

    charge = charge_now(token_user)
    with transaction.atomic():
        message_id = enqueue_task(POST_LEDGER_ENTRY, (charge.pk, charge.amount, charge.currency))
    # Not traced by coverage.py (conftest.unmeasured): killed with kill -9, it saves nothing.
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_PUBLISH], cwd=ROOT, env=unmeasured(env),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert OutboxMessage.objects.get().published_at is None
    time.sleep(1.1)  # the dead relay's lease runs out
    again = subprocess.run(
        [sys.executable, "manage.py", "idempotency_relay", "--once"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    wait_for(lambda: worker.count(f"[{message_id}] received") >= 2, timeout=30)
    wait_for(lambda: worker.count(f"{POST_LEDGER_ENTRY}[{message_id}] already ran"), timeout=30)
    assert ledger_rows(charge.pk) == 1
    assert OutboxMessage.objects.get().published_at is not None


# Requests ---------------------------------------------------------------------------------


def test_a_charge_is_captured_once_posted_once_and_reported(
    web: GunicornServer, worker: CeleryWorker, relay: Relay, processor: str, token_user: Any
) -> None:
    before = processor_stats(processor)
    key = str(uuid.uuid4())
    first = post_charge(web, token_user, key)
    assert first.status_code == 201, first.text
    assert first.json()["capture"].startswith("cap_")
    again = post_charge(web, token_user, key)
    assert again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"
    charge_id = first.json()["id"]
    # A running relay, as the demo runs it: the chain endpoint reports its heartbeat.
    with running(relay):
        wait_for(lambda: ledger_rows(charge_id), timeout=30)
        chain = requests.get(f"{web.url}/api/charges/chain/", timeout=10).json()
    assert chain["captures"] == before["captures"] + 1
    assert (chain["charges"], chain["ledger_rows"], chain["outbox_backlog"]) == (1, 1, 0)
    assert chain["dead_letters"] == 0
    assert chain["relay_owner"] == relay.owner and 0 <= chain["relay_heartbeat_age"] < 30


def test_a_charges_ledger_switches_reach_its_task_which_dies_after_its_commit_and_posts_once(
    web: GunicornServer, worker: CeleryWorker, relay: Relay, token_user: Any
) -> None:
    # How the reliability suite's chain profile makes the ledger task fail from a request.
    tag = uuid.uuid4().hex
    charge = post_charge(web, token_user, str(uuid.uuid4()), ledger_crash_after_commit_once=tag)
    assert charge.status_code == 201, charge.text
    message = OutboxMessage.objects.get()
    # The capture names the charge to the posting (testproject/payments/ledger.py).
    assert message.kwargs == {
        "capture": charge.json()["capture"],
        "crash_after_commit_once": tag,
    }
    assert relay.drain() == 1
    wait_for(lambda: worker.count(f"{POST_LEDGER_ENTRY}[{message.pk}] already ran"), timeout=30)
    assert ledger_rows(charge.json()["id"]) == 1


def test_a_rolled_back_request_leaves_no_outbox_row_and_no_task(
    web: GunicornServer, worker: CeleryWorker, relay: Relay, token_user: Any
) -> None:
    failed = post_charge(web, token_user, str(uuid.uuid4()), fail="after_write")
    assert failed.status_code == 500
    assert not Charge.objects.exists() and not OutboxMessage.objects.exists()
    assert relay.drain() == 0
    time.sleep(0.5)
    assert ledger_rows() == 0


def test_a_crash_after_the_processor_call_sends_the_same_key_on_retry_and_captures_once(
    web: GunicornServer, worker: CeleryWorker, relay: Relay, processor: str, token_user: Any
) -> None:
    before = processor_stats(processor)
    key, body = str(uuid.uuid4()), {"crash_once": uuid.uuid4().hex}
    # The request worker dies after the capture and before its commit: no answer.
    with pytest.raises(requests.ConnectionError):
        post_charge(web, token_user, key, **body)
    assert not Charge.objects.exists() and not OutboxMessage.objects.exists()
    after_crash = processor_stats(processor)
    assert after_crash["captures"] == before["captures"] + 1
    retried = post_charge(web, token_user, key, **body)
    assert retried.status_code == 201, retried.text
    after = processor_stats(processor)
    # The retry re-executed the charge and called the processor with the same key, which
    # answered with the first capture.
    assert after["captures"] == before["captures"] + 1
    assert after["replays"] == after_crash["replays"] + 1
    assert relay.drain() == 1
    wait_for(lambda: ledger_rows(retried.json()["id"]), timeout=30)
    assert ledger_rows() == 1 and Charge.objects.count() == 1


def test_after_a_crash_the_same_key_with_another_amount_captures_that_amount_under_another_key(
    web: GunicornServer, processor: str, token_user: Any
) -> None:
    before = processor_stats(processor)
    key, crash = str(uuid.uuid4()), uuid.uuid4().hex
    # Captured 2499 at the processor, then the request worker died before its commit.
    with pytest.raises(requests.ConnectionError):
        post_charge(web, token_user, key, crash_once=crash)
    assert processor_captures(processor)[-1]["amount"] == 2499
    # Never committed, so the key is free: the client sends another charge on it. A
    # processor key derived from the request key alone would be the first one's: refused
    # for ever (other parameters), or answered with the 2499 capture by a processor that
    # deduplicates on the key alone.
    other = post_charge(web, token_user, key, amount=1000, crash_once=crash)
    assert other.status_code == 201, other.text
    captured = processor_captures(processor)[-1]
    assert captured["amount"] == 1000 and other.json()["capture"] == captured["id"]
    after = processor_stats(processor)
    assert after["captures"] == before["captures"] + 2
    assert after["keys"] == before["keys"] + 2 and after["replays"] == before["replays"]
    assert Charge.objects.get().amount == 1000


def test_the_processors_webhook_settles_the_charge_once_however_often_it_is_delivered(
    web: GunicornServer, processor: str, token_user: Any
) -> None:
    from django.conf import settings

    from django_idempotency.models import IdempotencyRecord
    from testproject.payments.models import Settlement

    hook = {"url": f"{web.url}/api/webhooks/processor/", "secret": settings.PAYMENTS_WEBHOOK_SECRET}
    requests.post(f"{processor}/v1/webhook", json=hook, timeout=5).raise_for_status()
    try:
        before = processor_stats(processor)["webhooks_acknowledged"]
        charge = post_charge(web, token_user, str(uuid.uuid4()))
        assert charge.status_code == 201, charge.text
        # Delivered until answered (perhaps before the charge committed: a 503, not stored),
        # then once more: the same delivery id, answered with the first answer.
        wait_for(
            lambda: processor_stats(processor)["webhooks_acknowledged"] >= before + 2, timeout=30
        )
        assert Settlement.objects.filter(charge_id=charge.json()["id"]).count() == 1
        assert IdempotencyRecord.objects.filter(scope="webhook:processor").count() == 1
        # Someone who captured the processor's last attempt sends it again: under a new
        # delivery id it is refused (the signature covers the id), as it is it is answered
        # with the first answer. Neither settles the charge again.
        sent = requests.get(f"{processor}/v1/deliveries", timeout=5).json()["deliveries"]
        captured = sent[-1]
        body, headers = captured["body"].encode(), captured["headers"]
        delivery = headers["webhook-id"]
        for _ in range(3):
            forged = {**headers, "webhook-id": str(uuid.uuid4())}
            refused = requests.post(hook["url"], data=body, headers=forged, timeout=30)
            assert refused.status_code == 401, refused.text
        replayed = requests.post(hook["url"], data=body, headers=headers, timeout=30)
        assert replayed.status_code == 200 and replayed.headers["Idempotent-Replayed"] == "true"
        assert Settlement.objects.filter(charge_id=charge.json()["id"]).count() == 1
        assert Settlement.objects.get(charge_id=charge.json()["id"]).delivery == delivery
    finally:
        requests.post(f"{processor}/v1/webhook", json={"url": "", "secret": ""}, timeout=5)


def test_a_charge_without_a_key_is_refused_rather_than_captured_unprotected(
    web: GunicornServer, processor: str, token_user: Any
) -> None:
    before = processor_stats(processor)
    # Without an Idempotency-Key the view runs unprotected: derive_key() has no unit to
    # derive from, so the charge is refused rather than captured with a key that a retry
    # could not reproduce.
    response = requests.post(
        f"{web.url}/api/charges/", json={"amount": 2499, "currency": "inr"},
        headers=token_user.headers, timeout=30,
    )  # fmt: skip
    assert response.status_code == 500
    assert not Charge.objects.exists()
    assert processor_stats(processor)["captures"] == before["captures"]
