"""Order per key: messages that share an ordering key are published in commit order, each only
once the one before it is published, by one relay or several; other keys are never held up."""

from __future__ import annotations

import ast
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.contrib import admin
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.http import HttpRequest, JsonResponse
from django.test import Client
from django.urls import path
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.decorators import idempotent
from django_idempotency.messaging.outbox import OutboxError, enqueue_event, enqueue_task, leases
from django_idempotency.messaging.relay.loop import PublishFailed, Relay
from django_idempotency.models import OutboxMessage
from tests.conftest import unmeasured
from tests.messaging import test_relay
from tests.messaging.test_relay import bare_app, relay_process, run_on_sqlite, wait_started
from tests.support.chain_processes import RedisServer, wait_for

pytestmark = [
    pytest.mark.urls("tests.messaging.test_order"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
]

USING = DEFAULT_DB_ALIAS
# The relay processes' environment, as the relay's own tests make it.
relay_env = test_relay.relay_env
NAME = "tests.order.record"


def enqueue(key: str | None, n: int = 0) -> str:
    return enqueue_task(NAME, (key, n), ordering_key=key)


@csrf_exempt
@idempotent(allow_anonymous=True)
def ship(request: HttpRequest) -> JsonResponse:
    # Rows enqueued in a protected view travel with the stored response, keys and all.
    key = request.GET["order"]
    ids = [enqueue(key, 1), enqueue_event("order.shipped", {"order": key}), enqueue(key, 2)]
    return JsonResponse({"ids": ids}, status=201)


urlpatterns = [path("ship/", ship), path("admin/", admin.site.urls)]


def claim_all(owner: str = "relay") -> list[str]:
    """One claim of up to 100 rows, marked published at once; their ids in claim order."""
    batch = leases.claim(USING, owner=owner, limit=100)
    leases.mark(USING, batch, batch.messages, owner=owner, check=(), after=timedelta(0))
    return [m.id for m in batch.messages]


def waiting_for_a_key_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        (count,) = cursor.fetchone()
    return bool(count)


class InThread:
    """Runs ``work`` in a thread of its own, on a database connection of its own."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = work()
            except BaseException as exc:  # reported by join()
                self.error = exc
            finally:
                connections.close_all()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> Any:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the transaction never finished"
        if self.error is not None:
            raise self.error
        return self.result


def test_two_interleaved_transactions_on_one_key_are_published_in_commit_order() -> None:
    # A writes a1 and holds the key; B makes its message (and its id) and waits for the key;
    # A writes a2, whose id is later than B's, and commits first. Commit order is a1, a2, b:
    # the ids' order (a1, b, a2) is not.
    a_holds_the_key = threading.Event()
    a_may_go_on = threading.Event()
    a2: list[str] = []

    def transaction_a() -> str:
        with transaction.atomic():
            a1 = enqueue("order:1", 1)
            a_holds_the_key.set()
            assert a_may_go_on.wait(30)
            a2.append(enqueue("order:1", 2))
        return a1

    def transaction_b() -> str:
        with transaction.atomic():
            return enqueue("order:1", 3)

    a = InThread(transaction_a)
    assert a_holds_the_key.wait(30)
    b = InThread(transaction_b)
    wait_for(waiting_for_a_key_lock)  # B has its id, and waits for A
    a_may_go_on.set()
    a1, b_id = a.join(), b.join()
    assert sorted([a1, a2[0], b_id], key=uuid.UUID) == [a1, b_id, a2[0]]

    published = [claim_all() for _ in range(4)]
    assert published == [[a1], [a2[0]], [b_id], []]
    places = dict(OutboxMessage.objects.values_list("id", "ordering_seq"))
    assert places[uuid.UUID(a1)] < places[uuid.UUID(a2[0])] < places[uuid.UUID(b_id)]


def test_a_rolled_back_transaction_frees_the_key_and_keeps_no_place() -> None:
    holding = threading.Event()
    roll_back = threading.Event()

    def rolled_back() -> None:
        with transaction.atomic():
            enqueue("order:2", 1)
            holding.set()
            assert roll_back.wait(30)
            transaction.set_rollback(True)

    first = InThread(rolled_back)
    assert holding.wait(30)
    second = InThread(lambda: transaction.atomic()(enqueue)("order:2", 2))
    wait_for(waiting_for_a_key_lock)
    roll_back.set()
    first.join()
    kept = second.join()
    assert [str(i) for i in OutboxMessage.objects.values_list("id", flat=True)] == [kept]
    assert claim_all() == [kept]


def test_a_claim_takes_one_message_of_each_key_and_every_message_without_one() -> None:
    with transaction.atomic():
        k1, l1, free1, k2, l2, free2, k3 = (
            enqueue("k", 1), enqueue("l", 1), enqueue(None), enqueue("k", 2),
            enqueue("l", 2), enqueue(None), enqueue("k", 3),
        )  # fmt: skip
    assert claim_all() == [k1, l1, free1, free2]
    assert claim_all() == [k2, l2]
    assert claim_all() == [k3]
    assert claim_all() == []


def test_an_earlier_message_leased_to_another_relay_holds_its_key_back() -> None:
    with transaction.atomic():
        first, second, other = enqueue("k", 1), enqueue("k", 2), enqueue("other")
    taken = leases.claim(USING, owner="slow", limit=1)
    assert [m.id for m in taken.messages] == [first]
    assert claim_all("fast") == [other]  # not the second: the first is not published yet
    leases.mark(USING, taken, taken.messages, owner="slow", check=(), after=timedelta(0))
    assert claim_all("fast") == [second]


def test_a_failed_or_dead_message_blocks_its_key_until_requeued_and_no_other_key() -> None:
    with transaction.atomic():
        failing, after_it, other = enqueue("k", 1), enqueue("k", 2), enqueue("l", 1)
    batch = leases.claim(USING, owner="relay", limit=1)
    leases.fail(USING, batch, batch.messages[0], "refused", owner="relay", hold=True)
    assert claim_all() == [other]  # held back with backoff: k waits, l does not
    # Its tries used up, it is a dead letter: k waits for an operator.
    OutboxMessage.objects.filter(pk=failing).update(
        dead_at=timezone.now(), lease_until=None, lease_owner=""
    )
    assert claim_all() == []
    with transaction.atomic():
        later = enqueue("l", 2)
    assert claim_all() == [later]
    assert leases.requeue(USING, [failing]) == 1
    assert claim_all() == [failing]
    assert claim_all() == [after_it]


def test_a_protected_views_keyed_messages_keep_their_order_and_other_requests_theirs() -> None:
    client = Client()
    shipped = [
        client.post(f"/ship/?order={order}", headers={"Idempotency-Key": str(uuid.uuid4())})
        for order in ("order:7", "order:8", "order:7")
    ]
    assert [r.status_code for r in shipped] == [201, 201, 201]
    first, other, second = (r.json()["ids"] for r in shipped)
    # The head of each key, and every event (they have none).
    assert claim_all() == [first[0], first[1], other[0], other[1], second[1]]
    assert claim_all() == [first[2], other[2]]
    assert claim_all() == [second[0]]
    assert claim_all() == [second[2]]
    assert claim_all() == []


def test_events_and_tasks_share_a_key_and_the_order_between_them() -> None:
    with transaction.atomic():
        event = enqueue_event("order.paid", {"order": 5}, ordering_key="order:5")
        task = enqueue("order:5")
    assert [claim_all(), claim_all()] == [[event], [task]]


def test_the_admin_shows_a_messages_key_and_place(admin_client: Client) -> None:
    with transaction.atomic():
        enqueue("order:9", 1)
        message_id = enqueue("order:9", 2)
    place = OutboxMessage.objects.get(pk=message_id).ordering_seq
    page = admin_client.get(f"/admin/django_idempotency/outboxmessage/{message_id}/change/")
    text = page.content.decode()
    assert page.status_code == 200 and "order:9" in text
    assert "Place in its key&#x27;s order" in text and f">{place}<" in text


@pytest.mark.parametrize("key", ["", "x" * 256, 42, b"order:1"])
def test_an_ordering_key_that_is_not_a_short_string_is_refused_naming_the_fix(key: Any) -> None:
    with transaction.atomic(), pytest.raises(OutboxError, match="non-empty str of at most 255"):
        enqueue_task(NAME, ordering_key=key)
    assert not OutboxMessage.objects.exists()


SQLITE_SCRIPT = """
import json, django
django.setup()
from datetime import timedelta
from pathlib import Path
from django.core.management import call_command
from django.db import transaction
from django_idempotency.messaging.outbox import leases
from django_idempotency.messaging.outbox import enqueue_task

call_command("migrate", verbosity=0)
with transaction.atomic():
    ids = [enqueue_task("t", (n,), ordering_key=k) for n, k in enumerate("aab")]
    ids.append(enqueue_task("t", (3,)))
claims = []
for _ in range(3):
    batch = leases.claim("default", owner="r", limit=10)
    leases.mark("default", batch, batch.messages, owner="r", check=(), after=timedelta(0))
    claims.append([m.id for m in batch.messages])
print(json.dumps({"ids": ids, "claims": claims}))
"""


def test_on_sqlite_a_key_keeps_its_order_too(tmp_path: Path) -> None:
    result = run_on_sqlite(tmp_path, SQLITE_SCRIPT, "memory://")
    a1, a2, b, free = result["ids"]
    assert result["claims"] == [[a1, b, free], [a2], []]


# Against a broker ----------------------------------------------------------------------


@pytest.fixture
def app(private_redis: RedisServer) -> Celery:
    return bare_app(private_redis.url, "order-tests")


def queued_by_key(redis: RedisServer) -> dict[str, list[int]]:
    """The numbers the broker holds of each key, in the broker's order."""
    found: dict[str, list[int]] = {}
    for headers in redis.queued():
        key, n = _arguments(headers)
        found.setdefault(key, []).append(n)
    return found


def _arguments(headers: dict[str, Any]) -> tuple[str, int]:
    # argsrepr is the repr of the JSON arguments: ['key', n].
    key, n = ast.literal_eval(headers["argsrepr"])
    return str(key), int(n)


def test_one_relay_drains_a_keys_backlog_in_order_without_waiting_for_a_poll(
    app: Celery, private_redis: RedisServer
) -> None:
    with transaction.atomic():
        for n in range(30):
            enqueue("hot", n)
            enqueue(None, n) if n % 3 else enqueue("cold", n)
    assert Relay(app=app, batch_size=10).drain() == 60
    by_key = queued_by_key(private_redis)
    assert by_key["hot"] == list(range(30))
    assert by_key["cold"] == [n for n in range(30) if not n % 3]


REFUSING: list[bool] = []


def refuse_k1(name: str, args: Any, kwargs: Any, options: Any, **extra: Any) -> None:
    if REFUSING and list(args) == ["k", 1]:
        raise ValueError("no route for this one")


def test_a_message_that_fails_to_publish_holds_back_the_rest_of_its_key(
    app: Celery, private_redis: RedisServer
) -> None:
    app.conf.task_routes = (refuse_k1,)
    REFUSING[:] = [True]
    with transaction.atomic():
        first = enqueue("k", 1)
        enqueue("k", 2)
        enqueue("l", 1)
    with pytest.raises(PublishFailed, match="no route"):
        Relay(app=app).drain()
    # Its backoff made long enough that no busy machine sees it end during the next drain.
    held = OutboxMessage.objects.filter(pk=first, attempts=1)
    assert held.update(lease_until=timezone.now() + timedelta(hours=1)) == 1
    assert Relay(app=app).drain() == 1  # l's; k's second waits for its first
    assert queued_by_key(private_redis) == {"l": [1]}
    REFUSING.clear()
    OutboxMessage.objects.update(lease_until=None)  # its backoff made to end now
    assert Relay(app=app).drain() == 2
    assert queued_by_key(private_redis) == {"l": [1], "k": [1, 2]}


def test_two_relays_at_once_keep_each_keys_order(
    relay_env: Callable[..., dict[str, str]], private_redis: RedisServer
) -> None:
    keys = [f"account:{n}" for n in range(8)]
    env = unmeasured(relay_env())
    with (
        relay_process(env, "--batch-size", "7") as one,
        relay_process(env, "--batch-size", "7") as two,
    ):
        wait_started(one)
        wait_started(two)

        # Several writers at once, each transaction two messages of two keys, taken in a
        # consistent order (as with any locks: the docs say so).
        def writer(offset: int) -> None:
            for n in range(offset, 240, 4):
                with transaction.atomic():
                    for key in sorted({keys[n % 8], keys[(n * 3 + 1) % 8]}):
                        enqueue(key, n)

        writers = [InThread(lambda o=o: writer(o)) for o in range(4)]  # type: ignore[misc]
        for w in writers:
            w.join()
        wait_for(
            lambda: not OutboxMessage.objects.filter(published_at__isnull=True).exists(),
            timeout=120,
            every=0.1,
        )
    by_key = queued_by_key(private_redis)
    for key in keys:
        rows = OutboxMessage.objects.filter(ordering_key=key).order_by("ordering_seq")
        assert by_key[key] == [row.args[1] for row in rows], key
    assert sum(len(v) for v in by_key.values()) == OutboxMessage.objects.count() > 240
    owners = set(OutboxMessage.objects.values_list("lease_owner", flat=True))
    assert len(owners) == 2, "both relays should have published a share"
