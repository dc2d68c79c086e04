"""The outbox relay: throughput against a plain publish loop, commit-to-publish latency, and
what an ``enqueue_task()`` adds to a transaction.

The broker is a private ``redis-server`` on a free port (never the machine's), emptied between
cells, so that nothing consumes the messages and the queue's length is the count published.

1. Throughput: the same N task messages published (a) straight from a loop,
   ``app.send_task(..., task_id=...)`` on one producer, and (b) by ``Relay.drain()`` from N
   committed outbox rows (claim, publish, mark, in batches). Interleaved repeats; the ratio is
   the median of the repeats' ratios.
2. Latency: ``manage.py idempotency_relay`` as a process with a 60 s poll; one message per
   transaction, from the commit returning to the message being in the queue (``BRPOP``), so
   the relay is woken by ``NOTIFY`` or not at all in time.
3. Enqueue cost: a protected request's unit of work (claim, one business ``INSERT``, the
   stored response and its ``COMMIT``), with and without an ``enqueue_task()`` in it, back
   to back; the median of the pairs' differences. There the row rides with the store's
   statement. The same in a plain ``transaction.atomic()``, where it is an ``INSERT`` of
   its own, is reported too.

``python -m bench relay``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.nats_server import NATS_SERVER, NatsServer
from bench.report import Check, Section, median, percentile
from bench.server import ROOT, django_env, free_port

if TYPE_CHECKING:
    from bench.run import Options

TASK = "bench.relay.noop"
QUEUE = "celery"


class PrivateRedis:
    def __init__(self) -> None:
        self.port = free_port()
        self.directory = tempfile.mkdtemp(prefix="relay_bench_redis_")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> PrivateRedis:
        import redis

        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.directory],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port).ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port)


def setup_django(url: str, broker: str) -> None:
    os.environ.update(django_env(url))
    os.environ["CELERY_BROKER_URL"] = broker
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def make_app(broker: str, queue: str = QUEUE) -> Any:
    from celery import Celery

    app = Celery("relay-bench", set_as_current=False)
    app.conf.update(broker_url=broker, task_ignore_result=True, task_default_queue=queue)
    if broker.startswith("amqp"):
        # The loop publishes as the relay does: with publisher confirms.
        app.conf.broker_transport_options = {"confirm_publish": True}
    return app


RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def rabbitmq_cells(count: int, repeats: int) -> tuple[list[float], list[float], list[str]]:
    """Loop and relay rates on the machine's RabbitMQ (a queue of our own), or nothing."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
    except OSError:
        return [], [], []
    queue = f"relay-bench-{uuid.uuid4().hex[:8]}"
    app = make_app(RABBITMQ, queue)
    loop_rates: list[float] = []
    relay_rates: list[float] = []
    errors: list[str] = []
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        channel.queue_declare(queue, durable=True, auto_delete=False)
        try:
            for repeat in range(repeats):
                for cell in ["loop", "relay"] if repeat % 2 == 0 else ["relay", "loop"]:
                    channel.queue_purge(queue)
                    seconds = direct_loop(app, count) if cell == "loop" else relay_drain(app, count)
                    queued = channel.queue_declare(queue, passive=True).message_count
                    if queued != count:
                        errors.append(f"RabbitMQ {cell}: {queued} messages queued, not {count}")
                    (loop_rates if cell == "loop" else relay_rates).append(count / seconds)
        finally:
            channel.queue_delete(queue)
    return loop_rates, relay_rates, errors


def clear_outbox() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_idempotency_outbox")


def fill_outbox(count: int) -> None:
    from django.db import transaction

    from django_idempotency.messaging.outbox import enqueue_task

    done = 0
    while done < count:
        with transaction.atomic():
            for n in range(done, min(count, done + 500)):
                enqueue_task(TASK, (n, "inr"), {"amount": 2499})
        done = min(count, done + 500)


def direct_loop(app: Any, count: int) -> float:
    """Seconds to publish ``count`` messages from a loop on one producer."""
    with app.connection_for_write() as conn:
        producer = app.amqp.Producer(conn, auto_declare=False)
        started = time.perf_counter()
        for n in range(count):
            app.send_task(
                TASK,
                args=(n, "inr"),
                kwargs={"amount": 2499},
                task_id=str(uuid.uuid4()),
                producer=producer,
                retry=False,
                add_to_parent=False,
            )
        return time.perf_counter() - started


def relay_drain(app: Any, count: int) -> float:
    from django_idempotency.messaging.relay.loop import Relay

    clear_outbox()
    fill_outbox(count)
    relay = Relay(app=app)
    relay.destinations.by_name["default"].open()  # connect outside the timing, as the loop does
    started = time.perf_counter()
    published = relay.drain()
    elapsed = time.perf_counter() - started
    relay.destinations.close()
    if published != count:
        raise RuntimeError(f"the relay published {published} of {count}")
    return elapsed


# The bench's stream on its private nats-server, and the subjects the relay publishes to.
NATS_STREAM = "BENCH"
NATS_SUBJECT = "bench.outbox.{name}"


@contextlib.contextmanager
def private_nats() -> Iterator[NatsServer]:
    """A private ``nats-server -js`` (``bench/nats_server.py``) with the bench's stream."""
    with tempfile.TemporaryDirectory(prefix="relay_bench_nats_") as directory:
        server = NatsServer.on_free_port(Path(directory))
        server.start()
        try:
            server.add_stream(NATS_STREAM, ["bench.outbox.>"])
            yield server
        finally:
            server.stop()


def nats_settings(server: NatsServer) -> dict[str, Any]:
    backend = "django_idempotency.messaging.destinations.nats.NatsDestination"
    options = {"servers": [server.url], "subject": NATS_SUBJECT}
    return {"default": {"BACKEND": backend, "OPTIONS": options}}


def nats_loop(server: NatsServer, count: int) -> float:
    """Seconds for a plain loop to publish ``count`` messages with nats-py's own async
    JetStream publish (the same client, the same bodies and ids), waiting for every ack."""
    import asyncio
    import json

    import nats

    async def run() -> float:
        client = await nats.connect(server.url)
        js = client.jetstream()
        try:
            started = time.perf_counter()
            for start in range(0, count, 500):
                futures = []
                for n in range(start, min(count, start + 500)):
                    body = json.dumps({"args": [n, "inr"], "kwargs": {"amount": 2499}}).encode()
                    futures.append(
                        await js.publish_async(
                            f"bench.outbox.{TASK}", body, headers={"Nats-Msg-Id": str(uuid.uuid4())}
                        )
                    )
                await asyncio.gather(*futures)
            return time.perf_counter() - started
        finally:
            await client.close()

    return asyncio.run(run())


def nats_relay(server: NatsServer, count: int) -> float:
    from django.test import override_settings

    from django_idempotency.messaging.relay.loop import Relay

    clear_outbox()
    fill_outbox(count)
    with override_settings(IDEMPOTENCY_OUTBOX_DESTINATIONS=nats_settings(server)):
        relay = Relay()
        relay.destinations.by_name["default"].open()  # connected outside the timing
        started = time.perf_counter()
        published = relay.drain()
        elapsed = time.perf_counter() - started
        relay.destinations.close()
    if published != count:
        raise RuntimeError(f"the relay published {published} of {count}")
    return elapsed


def nats_cells(
    count: int, repeats: int, url: str, samples: int
) -> tuple[list[float], list[float], list[float], list[str]]:
    """Loop and relay rates and commit-to-publish delays on a private nats-server -js, or
    nothing without one."""
    if NATS_SERVER is None:
        return [], [], [], []
    loop_rates: list[float] = []
    relay_rates: list[float] = []
    errors: list[str] = []
    with private_nats() as server:
        delays = nats_latency(server, url, samples)
        for repeat in range(repeats):
            for cell in ["loop", "relay"] if repeat % 2 == 0 else ["relay", "loop"]:
                server.purge(NATS_STREAM)
                run_cell = nats_loop if cell == "loop" else nats_relay
                seconds = run_cell(server, count)
                stored = server.count(NATS_STREAM)
                if stored != count:
                    errors.append(f"NATS {cell}: {stored} messages in the stream, not {count}")
                (loop_rates if cell == "loop" else relay_rates).append(count / seconds)
    return loop_rates, relay_rates, delays, errors


def tasks_noop(n: int, currency: str, amount: int) -> None:
    """The Django Tasks cells' task (never run: nothing consumes the queue)."""


def tasks_settings(redis_url: str) -> dict[str, Any]:
    """Django's Tasks framework through the outbox to RQ, on the private redis-server."""
    from django_idempotency.messaging.destinations import CELERY, TASKS

    return {
        "TASKS": {
            "default": {
                "BACKEND": "django_idempotency.messaging.task_backend.OutboxBackend",
                "OPTIONS": {"backend": "rq"},
            },
            "rq": {"BACKEND": "django_tasks_rq.RQBackend"},
        },
        "RQ_QUEUES": {"default": {"URL": redis_url}},
        "IDEMPOTENCY_OUTBOX_DESTINATIONS": {
            "default": {"BACKEND": CELERY},
            "tasks": {"BACKEND": TASKS},
        },
    }


def tasks_loop(count: int) -> float:
    """Seconds for a plain loop to enqueue ``count`` jobs with the real backend itself (the
    same client, the same task and arguments the destination enqueues)."""
    from django_idempotency.messaging.consumers.tasks import DELIVER
    from django_idempotency.messaging.tasks_framework import task_backends

    backend = task_backends["rq"]
    job = DELIVER.using(backend="rq")
    started = time.perf_counter()
    for n in range(count):
        args = [str(uuid.uuid4()), f"{__name__}.tasks_noop", [n, "inr"], {"amount": 2499}]
        backend.enqueue(job, args, {})
    return time.perf_counter() - started


def tasks_relay(count: int) -> float:
    from django.db import transaction

    from django_idempotency.messaging.relay.loop import Relay
    from django_idempotency.messaging.tasks_framework import Task, task_backends

    clear_outbox()
    outbox = task_backends["default"]
    noop: Task[..., Any] = Task(
        func=tasks_noop, priority=0, backend="default", queue_name="default", run_after=None,
        takes_context=False,
    )  # fmt: skip
    for start in range(0, count, 500):
        with transaction.atomic():
            for n in range(start, min(count, start + 500)):
                outbox.enqueue(noop, [n, "inr"], {"amount": 2499})
    relay = Relay()
    started = time.perf_counter()
    published = relay.drain()
    elapsed = time.perf_counter() - started
    relay.destinations.close()
    if published != count:
        raise RuntimeError(f"the relay published {published} of {count}")
    return elapsed


def tasks_cells(count: int, repeats: int) -> tuple[list[float], list[float], list[str]]:
    """Loop and relay rates of Django's Tasks framework through RQ on a private redis-server,
    or nothing without django-tasks-rq."""
    import importlib.util

    if importlib.util.find_spec("django_tasks_rq") is None:
        return [], [], []
    import contextlib

    from django.test import override_settings

    with contextlib.suppress(ImportError):  # the backport resets its backends on a change
        import django_tasks.signals  # noqa: F401
    loop_rates: list[float] = []
    relay_rates: list[float] = []
    errors: list[str] = []
    with PrivateRedis() as server, override_settings(**tasks_settings(server.url)):
        client = server.client()
        for repeat in range(repeats):
            for cell in ["loop", "relay"] if repeat % 2 == 0 else ["relay", "loop"]:
                client.flushall()
                seconds = tasks_loop(count) if cell == "loop" else tasks_relay(count)
                queued = client.llen("rq:queue:default")
                if queued != count:
                    errors.append(f"Django Tasks {cell}: {queued} jobs queued, not {count}")
                (loop_rates if cell == "loop" else relay_rates).append(count / seconds)
    return loop_rates, relay_rates, errors


@contextlib.contextmanager
def relay_process(url: str, env: dict[str, str], settings: str = "") -> Iterator[None]:
    """``manage.py idempotency_relay`` as a process with a 60 s poll (and ``settings``, more
    lines of its settings module), started and listening."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "relay_bench_settings.py").write_text(
            "from datetime import timedelta\nfrom testproject.settings import *  # noqa\n"
            "IDEMPOTENCY_OUTBOX_POLL_INTERVAL = timedelta(seconds=60)\n" + settings
        )
        env = {
            **django_env(url),
            **env,
            "DJANGO_SETTINGS_MODULE": "relay_bench_settings",
            "PYTHONPATH": os.pathsep.join([tmp, str(ROOT)]),
            # Its start is read from its INFO line.
            "IDEMPOTENCY_LOG_LEVEL": "INFO",
        }
        log = Path(tmp) / "relay.log"
        with log.open("wb") as out:
            relay = subprocess.Popen(
                [sys.executable, "manage.py", "idempotency_relay"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while b"started on database" not in log.read_bytes():
                if relay.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the relay did not start:\n{log.read_text()}")
                time.sleep(0.05)
            time.sleep(0.5)
            yield
        finally:
            relay.terminate()
            relay.wait(timeout=20)


def commit_to_publish(samples: int, arrived: Callable[[], bool]) -> list[float]:
    """One message per transaction; seconds from the commit returning to ``arrived()``."""
    from django.db import transaction

    from django_idempotency.messaging.outbox import enqueue_task

    delays = []
    for n in range(samples):
        with transaction.atomic():
            enqueue_task(TASK, (n,))
        committed = time.perf_counter()
        if not arrived():
            raise RuntimeError("a committed message was not published within 10 s")
        delays.append(time.perf_counter() - committed)
        time.sleep(0.01)
    return delays


def latency(redis_server: PrivateRedis, url: str, samples: int) -> list[float]:
    client = redis_server.client()
    client.flushall()
    clear_outbox()
    with relay_process(url, {"CELERY_BROKER_URL": redis_server.url}):
        return commit_to_publish(samples, lambda: client.brpop([QUEUE], timeout=10) is not None)


def nats_latency(server: NatsServer, url: str, samples: int) -> list[float]:
    """As ``latency``, the relay publishing to the private NATS stream; a message arrives
    when a plain subscriber on its subject receives it."""
    import queue

    import nats

    from django_idempotency.messaging.nats_client import ClientLoop

    clear_outbox()
    received: queue.Queue[bytes] = queue.Queue()
    loop = ClientLoop("bench-nats-subscriber")

    async def subscribe() -> Any:
        client = await nats.connect(server.url)

        async def take(message: Any) -> None:
            received.put(message.data)

        await client.subscribe("bench.outbox.>", cb=take)
        await client.flush()
        return client

    client = loop.run(subscribe(), 10)
    try:
        settings = f"IDEMPOTENCY_OUTBOX_DESTINATIONS = {nats_settings(server)!r}\n"
        with relay_process(url, {}, settings):

            def arrived() -> bool:
                try:
                    received.get(timeout=10)
                except queue.Empty:
                    return False
                return True

            return commit_to_publish(samples, arrived)
    finally:
        loop.run(client.close(), 10)
        loop.stop()


def enqueue_cost_in_unit(samples: int) -> tuple[list[float], list[float]]:
    """(a protected request's unit of work, the same with an enqueue), seconds."""
    from django.db import connection

    from django_idempotency.engine.unit import UnitOfWork
    from django_idempotency.engine.work import Result, Run, Work
    from django_idempotency.messaging.outbox import enqueue_task

    insert = "INSERT INTO relay_bench_business (amount, currency) VALUES (%s, %s)"
    plain: list[float] = []
    with_enqueue: list[float] = []
    for n in range(samples):
        for enqueue in (n % 2 == 0, n % 2 == 1):
            work = Work(
                principal="bench:relay",
                key=str(uuid.uuid4()),
                method="POST",
                path="/bench/",
                fingerprint={},
                ttl=timedelta(hours=1),
            )
            started = time.perf_counter()
            unit = UnitOfWork(work, wait=timedelta(0))
            assert isinstance(unit.open(), Run)
            with connection.cursor() as cursor:
                cursor.execute(insert, [2499, "inr"])
            if enqueue:
                enqueue_task(TASK, (n, "inr"), {"amount": 2499})
            unit.close(Result(201, [["content-type", "application/json"]], b'{"id": 1}'))
            (with_enqueue if enqueue else plain).append(time.perf_counter() - started)
    return plain, with_enqueue


def enqueue_cost(samples: int) -> tuple[list[float], list[float], list[float]]:
    """(plain transaction, transaction with an enqueue, the enqueue call alone), seconds."""
    from django.db import connection, transaction

    from django_idempotency.messaging.outbox import enqueue_task

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS relay_bench_business (id bigserial PRIMARY KEY, "
            "amount integer NOT NULL, currency text NOT NULL)"
        )
    insert = "INSERT INTO relay_bench_business (amount, currency) VALUES (%s, %s)"
    plain: list[float] = []
    with_enqueue: list[float] = []
    call: list[float] = []
    for n in range(samples):
        for enqueue in (n % 2 == 0, n % 2 == 1):
            started = time.perf_counter()
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(insert, [2499, "inr"])
                if enqueue:
                    before = time.perf_counter()
                    enqueue_task(TASK, (n, "inr"), {"amount": 2499})
                    call.append(time.perf_counter() - before)
            (with_enqueue if enqueue else plain).append(time.perf_counter() - started)
    return plain, with_enqueue, call


def drop_business_table() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE relay_bench_business")


def run(options: Options) -> Section:
    quick = options.requests <= 100
    count = 5_000 if quick else 20_000
    samples = 100 if quick else 400
    errors: list[str] = []
    with PrivateRedis() as redis_server:
        setup_django(options.database_url, redis_server.url)
        app = make_app(redis_server.url)
        client = redis_server.client()
        ratios, loop_rates, relay_rates = [], [], []
        for repeat in range(options.repeats):
            cells = ["loop", "relay"] if repeat % 2 == 0 else ["relay", "loop"]
            rates = {}
            for cell in cells:
                client.flushall()
                seconds = direct_loop(app, count) if cell == "loop" else relay_drain(app, count)
                if client.llen(QUEUE) != count:
                    errors.append(f"{cell}: {client.llen(QUEUE)} messages queued, not {count}")
                rates[cell] = count / seconds
            loop_rates.append(rates["loop"])
            relay_rates.append(rates["relay"])
            ratios.append(rates["relay"] / rates["loop"])
        rabbit_loop, rabbit_relay, rabbit_errors = rabbitmq_cells(count // 4, options.repeats)
        errors += rabbit_errors
        nats_loop_rates, nats_relay_rates, nats_delays, nats_errors = nats_cells(
            count, options.repeats, options.database_url, samples
        )
        errors += nats_errors
        tasks_loop_rates, tasks_relay_rates, tasks_errors = tasks_cells(count // 4, options.repeats)
        errors += tasks_errors
        delays = latency(redis_server, options.database_url, samples)
        plain, with_enqueue, call = enqueue_cost(samples * 5)
        unit_plain, unit_enqueue = enqueue_cost_in_unit(samples * 5)
        drop_business_table()
        clear_outbox()
    ms = 1000.0
    p50, p99 = median(delays) * ms, percentile(delays, 99) * ms
    # Pairs run back to back, so a drift in the machine's load cancels out of each difference.
    added = median([w - p for w, p in zip(with_enqueue, plain, strict=True)]) * ms
    added_in_unit = median([w - p for w, p in zip(unit_enqueue, unit_plain, strict=True)]) * ms
    # Each repeat's relay rate over its loop's, the two measured side by side.
    nats_ratios = [r / loop for r, loop in zip(nats_relay_rates, nats_loop_rates, strict=True)]
    tasks_ratios = [r / loop for r, loop in zip(tasks_relay_rates, tasks_loop_rates, strict=True)]
    header = ["measure", "value"]
    rows = [
        ["messages per throughput cell", f"{count:,}"],
        ["publish loop, messages/s (median)", f"{median(loop_rates):,.0f}"],
        ["relay, rows/s (median)", f"{median(relay_rates):,.0f}"],
        ["relay / loop, per repeat", ", ".join(f"{r:.2f}" for r in ratios)],
        *(
            [
                ["RabbitMQ with confirms: messages per cell", f"{count // 4:,}"],
                ["RabbitMQ publish loop, messages/s (median)", f"{median(rabbit_loop):,.0f}"],
                ["RabbitMQ relay, rows/s (median)", f"{median(rabbit_relay):,.0f}"],
            ]
            if rabbit_loop
            else []
        ),
        *(
            [
                ["NATS JetStream: messages per cell", f"{count:,}"],
                [
                    "NATS publish loop (publish_async), messages/s (median)",
                    f"{median(nats_loop_rates):,.0f}",
                ],
                ["NATS relay, rows/s (median)", f"{median(nats_relay_rates):,.0f}"],
                [
                    "NATS relay / loop, per repeat",
                    ", ".join(f"{r:.2f}" for r in nats_ratios),
                ],
                ["NATS commit to publish, p50 ms", f"{median(nats_delays) * ms:.1f}"],
                ["NATS commit to publish, p99 ms", f"{percentile(nats_delays, 99) * ms:.1f}"],
                ["NATS commit to publish, max ms", f"{max(nats_delays) * ms:.1f}"],
            ]
            if nats_loop_rates
            else []
        ),
        *(
            [
                ["Django Tasks through RQ: jobs per cell", f"{count // 4:,}"],
                [
                    "RQ enqueue loop (RQBackend.enqueue), jobs/s (median)",
                    f"{median(tasks_loop_rates):,.0f}",
                ],
                ["Django Tasks relay, rows/s (median)", f"{median(tasks_relay_rates):,.0f}"],
                [
                    "Django Tasks relay / loop, per repeat",
                    ", ".join(f"{r:.2f}" for r in tasks_ratios),
                ],
            ]
            if tasks_loop_rates
            else []
        ),
        ["commit to publish, p50 ms", f"{p50:.1f}"],
        ["commit to publish, p99 ms", f"{p99:.1f}"],
        ["commit to publish, max ms", f"{max(delays) * ms:.1f}"],
        ["protected unit of work without enqueue, median ms", f"{median(unit_plain) * ms:.3f}"],
        ["protected unit of work with enqueue, median ms", f"{median(unit_enqueue) * ms:.3f}"],
        ["added by the enqueue there, median of pairs, ms", f"{added_in_unit:.3f}"],
        ["plain transaction without enqueue, median ms", f"{median(plain) * ms:.3f}"],
        ["plain transaction with enqueue, median ms", f"{median(with_enqueue) * ms:.3f}"],
        ["added by the enqueue there (an INSERT of its own), ms", f"{added:.3f}"],
        ["enqueue_task() call alone in it, median ms", f"{median(call) * ms:.3f}"],
    ]
    checks = [
        Check("relay throughput / publish loop", statistics.median(ratios), 0.8, at_most=False),
        Check(
            "relay rows/s / 5,000",
            median(relay_rates) / 5000,
            1.0,
            at_most=False,
            note=f"{median(relay_rates):,.0f} rows/s",
        ),
        *(
            [
                Check(
                    "NATS relay throughput / publish loop",
                    median(nats_ratios),
                    0.8,
                    at_most=False,
                ),
                Check(
                    "NATS relay rows/s / 5,000",
                    median(nats_relay_rates) / 5000,
                    1.0,
                    at_most=False,
                    note=f"{median(nats_relay_rates):,.0f} rows/s",
                ),
                Check(
                    "NATS commit-to-publish p50 / 20 ms",
                    median(nats_delays) * ms / 20,
                    1.0,
                    at_most=True,
                    note=f"{median(nats_delays) * ms:.1f} ms",
                ),
                Check(
                    "NATS commit-to-publish p99 / 100 ms",
                    percentile(nats_delays, 99) * ms / 100,
                    1.0,
                    at_most=True,
                    note=f"{percentile(nats_delays, 99) * ms:.1f} ms",
                ),
            ]
            if nats_loop_rates
            else []
        ),
        *(
            [
                Check(
                    "Django Tasks relay throughput / enqueue loop",
                    median(tasks_ratios),
                    0.8,
                    at_most=False,
                )
            ]
            if tasks_loop_rates
            else []
        ),
        Check("commit-to-publish p50 / 20 ms", p50 / 20, 1.0, at_most=True, note=f"{p50:.1f} ms"),
        Check("commit-to-publish p99 / 100 ms", p99 / 100, 1.0, at_most=True, note=f"{p99:.1f} ms"),
        Check(
            "enqueue cost in a protected request / 0.3 ms",
            added_in_unit / 0.3,
            1.0,
            at_most=True,
            note=f"{added_in_unit:.3f} ms; in a plain transaction {added:.3f} ms",
        ),
    ]
    notes = [
        "Broker: a private redis-server, nothing consuming. The relay publishes in batches of "
        "IDEMPOTENCY_OUTBOX_BATCH_SIZE (one Redis pipeline each); the loop publishes the same "
        "messages one by one on one producer, as task.delay() would. RabbitMQ rows: the "
        "machine's server, a queue of our own, publisher confirms in both (no target). NATS "
        "rows: a private nats-server -js and a stream of its own; the loop publishes the same "
        "bodies with nats-py's publish_async and waits for every acknowledgement. Django Tasks "
        "rows: through the outbox backend to django-tasks-rq on a private redis-server; the "
        "loop enqueues the same jobs (task_runner.deliver, the same arguments) with "
        "RQBackend.enqueue().",
    ]
    data = {
        "count": count,
        "ratios": ratios,
        "loop_rates": loop_rates,
        "relay_rates": relay_rates,
        "rabbitmq_loop_rates": rabbit_loop,
        "rabbitmq_relay_rates": rabbit_relay,
        "nats_loop_rates": nats_loop_rates,
        "nats_relay_rates": nats_relay_rates,
        "tasks_loop_rates": tasks_loop_rates,
        "tasks_relay_rates": tasks_relay_rates,
        "nats_latency_seconds": nats_delays,
        "latency_seconds": delays,
        "plain_transaction_seconds": plain,
        "enqueue_transaction_seconds": with_enqueue,
        "enqueue_call_seconds": call,
        "unit_seconds": unit_plain,
        "unit_enqueue_seconds": unit_enqueue,
    }
    return Section("Outbox relay", header, rows, checks, notes, data, errors)


if __name__ == "__main__":
    from bench.run import main

    sys.exit(main(["relay", *sys.argv[1:]]))
