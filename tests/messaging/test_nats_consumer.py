"""The exactly-once NATS JetStream consumer against a private ``nats-server -js``: one effect
per message id through a handler that raises, a consumer process killed (SIGKILL) in the
middle of its handler and after its commit but before its ack, and the same id published
again once the stream's duplicate window has passed."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nats")
import nats.errors
import nats.js.errors
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections

from django_idempotency.messaging.consumers.nats import NatsConsumer, StreamMessage
from django_idempotency.messaging.nats_client import ClientLoop
from django_idempotency.models import IdempotencyRecord
from tests.conftest import ROOT, die_with_parent
from tests.support import nats_handlers
from tests.support.chain_processes import wait_for
from tests.support.nats_server import NATS_SERVER, NatsServer

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
    pytest.mark.skipif(NATS_SERVER is None, reason="needs nats-server (Debian: nats-server)"),
]

DURABLE = "ledger"
HANDLER = "tests.support.nats_handlers.record_effect"


@pytest.fixture
def nats_server(nats_server: NatsServer) -> NatsServer:
    """The shared private server, with a stream whose duplicate window is short, so that a
    test can publish an id again past it."""
    nats_server.add_stream(duplicate_window=1)
    return nats_server


@pytest.fixture(autouse=True)
def effects_table() -> Iterator[None]:
    nats_handlers.create_table()
    yield
    nats_handlers.drop_table()


def consumer(server: NatsServer, **options: Any) -> NatsConsumer:
    options = {"ack_wait": 2.0, "nak_delay": 0.2, **options}
    return NatsConsumer(
        nats_handlers.record_effect,
        stream="OUTBOX",
        durable=DURABLE,
        servers=[server.url],
        **options,
    )


def publish(server: NatsServer, fault: str = "", message_id: str | None = None) -> str:
    message_id = message_id or str(uuid.uuid4())
    body = json.dumps({"charge": message_id, "fault": fault}).encode()
    server.publish("outbox.payments.captured", body, message_id)
    return message_id


def settled(server: NatsServer) -> bool:
    """Every message delivered and acknowledged."""
    try:
        info = server.consumer_info(DURABLE)
    except nats.js.errors.NotFoundError:  # no consumer has started yet
        return False
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


def consume_until_settled(running: NatsConsumer, server: NatsServer) -> None:
    def step() -> bool:
        running.poll(timeout=0.2)
        return settled(server)

    try:
        wait_for(step, timeout=60, every=0)
    finally:
        running.close()


def test_each_message_takes_effect_once_and_is_acknowledged(nats_server: NatsServer) -> None:
    ids = [publish(nats_server) for _ in range(5)]
    consume_until_settled(consumer(nats_server), nats_server)
    assert nats_handlers.effects() == dict.fromkeys(ids, 1)
    # The record of each: scoped by the durable's name, keyed by Nats-Msg-Id.
    keys = IdempotencyRecord.objects.filter(scope=f"consumer:{DURABLE}")
    assert sorted(keys.values_list("key", flat=True)) == sorted(ids)


def test_a_handler_that_raises_leaves_nothing_and_runs_again(nats_server: NatsServer) -> None:
    failing, plain = publish(nats_server, fault="raise"), publish(nats_server)
    consume_until_settled(consumer(nats_server), nats_server)
    # The first delivery's row was rolled back with its record; the second committed.
    assert nats_handlers.effects() == {failing: 1, plain: 1}
    assert nats_server.consumer_info(DURABLE).delivered.stream_seq == 2


def test_the_same_id_published_again_past_the_duplicate_window_has_no_second_effect(
    nats_server: NatsServer,
) -> None:
    message_id = publish(nats_server)
    consume_until_settled(consumer(nats_server), nats_server)
    time.sleep(1.5)  # past the stream's 1 s duplicate window: the stream keeps a second copy
    publish(nats_server, message_id=message_id)
    assert nats_server.ids() == {message_id: 2}
    consume_until_settled(consumer(nats_server), nats_server)
    assert nats_handlers.effects() == {message_id: 1}


def consumed_then_published_with_another_body(server: NatsServer) -> str:
    """A message consumed, then its id published again past the duplicate window with
    another body; its id."""
    message_id = publish(server)
    consume_until_settled(consumer(server), server)
    time.sleep(1.5)
    publish(server, fault="other body", message_id=message_id)
    return message_id


def test_the_same_id_with_another_body_is_not_run_and_not_delivered_again(
    nats_server: NatsServer,
) -> None:
    message_id = consumed_then_published_with_another_body(nats_server)
    consume_until_settled(consumer(nats_server), nats_server)  # terminated, not pending
    assert nats_handlers.effects() == {message_id: 1}


def test_the_same_id_with_another_body_is_logged_as_an_error_not_taken_for_a_redelivery(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Taken for a redelivery, it would be acknowledged as already run: not run either, but
    # silently, and the sender's bug (one id for two messages) would go unseen.
    message_id = consumed_then_published_with_another_body(nats_server)
    with caplog.at_level(logging.INFO, logger="django_idempotency.consumers"):
        consume_until_settled(consumer(nats_server), nats_server)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if message_id in r.getMessage()]
    assert said == [
        (
            logging.ERROR,
            f"Task outbox.payments.captured[{message_id}] was delivered again with different "
            "arguments; it was not run.",
        )
    ]


def test_a_message_without_a_msg_id_is_keyed_by_its_stream_sequence(
    nats_server: NatsServer,
) -> None:
    nats_server.publish("outbox.plain", b'{"fault": ""}')
    consume_until_settled(consumer(nats_server), nats_server)
    assert nats_handlers.effects() == {"OUTBOX:1": 1}


def test_a_delivery_that_finds_another_still_running_goes_back_to_the_stream(
    nats_server: NatsServer, settings: Any
) -> None:
    # The first delivery holds the message's claim past ack_wait; JetStream delivers it
    # again, to a second consumer, which finds it running. Acknowledged there, the message
    # would be lost when the first delivery then fails; given back, it runs once.
    settings.IDEMPOTENCY_CONSUMER_WAIT = timedelta(milliseconds=200)
    message_id = publish(nats_server)
    holding, release = threading.Event(), threading.Event()

    def slow_then_failing(message: StreamMessage) -> None:
        nats_handlers.record_effect(message)
        holding.set()
        assert release.wait(60)
        raise RuntimeError("the first delivery fails once the second has been refused")

    first = NatsConsumer(
        slow_then_failing,
        stream="OUTBOX",
        durable=DURABLE,
        servers=[nats_server.url],
        # One at a time, so that no pull request of the first is left open to take the
        # redelivery meant for the second.
        batch=1,
        ack_wait=1.0,
        nak_delay=0.2,
    )

    def run_first() -> None:
        try:
            first.poll(timeout=10)
        finally:
            first.close()
            connections.close_all()

    thread = threading.Thread(target=run_first, daemon=True)
    thread.start()
    assert holding.wait(30)
    second = consumer(nats_server, batch=1, ack_wait=1.0)
    try:
        try:
            # Delivered again once the first delivery's ack_wait has passed; refused there.
            assert second.poll(timeout=10) == 1
            assert nats_handlers.effects() == {}  # the first delivery's row is uncommitted
        finally:
            release.set()
            thread.join(60)
        assert not thread.is_alive()
        assert second.poll(timeout=10) == 1, "the message never came back"
    finally:
        second.close()
    assert nats_handlers.effects() == {message_id: 1}
    wait_for(lambda: settled(nats_server))


def test_a_fetch_that_finds_nothing_reaches_poll_as_natss_own_timeout() -> None:
    # What poll() catches to return 0; shown without a server, since an idle poll's
    # TimeoutError leaves the client's drain to time out, and the session unstable.
    loop = ClientLoop("test-empty-fetch")

    async def empty_fetch() -> None:
        raise nats.errors.TimeoutError

    try:
        with pytest.raises(nats.errors.TimeoutError):
            loop.run(empty_fetch(), 5)
    finally:
        loop.stop()


def test_bad_arguments_are_refused_with_the_fix(nats_server: NatsServer) -> None:
    with pytest.raises(ImproperlyConfigured, match="stream and a durable"):
        NatsConsumer(nats_handlers.record_effect, stream="", durable=DURABLE)
    with pytest.raises(ImproperlyConfigured, match="batch >= 1"):
        consumer(nats_server, batch=0)
    with pytest.raises(CommandError, match="cannot be imported"):
        call_command(
            "idempotency_consume_nats", "--stream=OUTBOX", "--durable=d", "--handler=no.such"
        )
    with pytest.raises(CommandError, match=r"JetStream refused the consumer.*stream not found"):
        call_command(
            "idempotency_consume_nats",
            "--stream=NONE",
            "--durable=d",
            f"--handler={HANDLER}",
            f"--servers={nats_server.url}",
            verbosity=0,
        )


# A consumer process killed -------------------------------------------------------------


def start_consumer(env: dict[str, str], server: NatsServer, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "manage.py", "idempotency_consume_nats", "--stream=OUTBOX",
             f"--durable={DURABLE}", f"--handler={HANDLER}", f"--servers={server.url}",
             "--ack-wait=1", "--batch=5"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )  # fmt: skip


def test_a_consumer_killed_mid_handler_and_after_commit_applies_each_message_once(
    nats_server: NatsServer, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    ids = [publish(nats_server) for _ in range(4)]
    ids.append(publish(nats_server, fault="mid"))
    ids += [publish(nats_server) for _ in range(3)]
    ids.append(publish(nats_server, fault="after_commit"))
    ids += [publish(nats_server) for _ in range(3)]
    log = tmp_path / "consumer.log"
    kills = 0
    while not settled(nats_server):
        process = start_consumer(subprocess_env, nats_server, log)
        try:
            # Dead (a fault) or done with every message.
            wait_for(lambda: process.poll() is not None or settled(nats_server), 60, 0.1)  # noqa: B023
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=20)
        if process.returncode == -signal.SIGKILL:
            kills += 1
        assert kills <= 2 and process.returncode in (0, -signal.SIGKILL), log.read_text()
    assert kills == 2, log.read_text()
    assert nats_handlers.effects() == dict.fromkeys(ids, 1)


def test_the_handler_sees_the_message(nats_server: NatsServer) -> None:
    seen: list[StreamMessage] = []
    message_id = publish(nats_server)
    running = NatsConsumer(
        seen.append, stream="OUTBOX", durable="seeing", servers=[nats_server.url]
    )
    wait_for(lambda: running.poll(timeout=0.2) or seen, timeout=30, every=0)
    running.close()
    (message,) = seen
    assert (message.id, message.subject, message.delivered) == (
        message_id,
        "outbox.payments.captured",
        1,
    )
    assert message.json() == {"charge": message_id, "fault": ""}
