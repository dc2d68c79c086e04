"""A failover of the records' database under retried traffic (issue 33): a primary and its
streaming replica on loopback, the payments API, the relay and a Celery worker pointed at both
through libpq's multi-host form; ``kill -9`` of the primary mid-traffic, the replica promoted;
every client retries its charge until it is answered. Then every count is compared.

Under synchronous replication (the suite's short run, and the profile's longer one with
several failovers): every charge answered is on the new primary with one capture at the
processor, one ledger row, one consumer record and one settlement by the processor's webhook;
nothing lost, nothing twice. The profile's asynchronous runs measure what a failover can lose
(``docs/deployment.md``, "Failover"), and no charge is settled twice.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import uuid
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("celery")

from django_idempotency.messaging.relay.heartbeats import BEAT_EVERY
from django_idempotency.probe.facts import Fact, replication
from tests.support.chain_processes import wait_for
from tests.support.failover import DATABASE, Chain, Client, chain
from tests.support.servers import postgres_bin

# Outbox rows written since a time, published: seconds from the write to the publish.
PUBLISHED = (
    "SELECT extract(epoch FROM published_at - created_at)::float "
    "FROM django_idempotency_outbox WHERE published_at IS NOT NULL AND created_at > %s"
)

pytestmark = [
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


@pytest.fixture(autouse=True)
def binaries() -> None:
    try:
        postgres_bin()
    except LookupError as exc:
        pytest.skip(f"cannot make a replica: {exc}")


def outcome(run: Chain, clients: list[Client], answered: int) -> dict[str, Any]:
    """What the run left: counts on the final primary and at the processor."""
    pair = run.pair
    keys = [key for client in clients for key in client.answered]
    outbox = {str(pk) for (pk,) in pair.rows("SELECT id FROM django_idempotency_outbox")}
    deliveries = Counter(
        re.findall(r"post_ledger_entry\[([0-9a-f-]{36})\] received", run.worker.text())
    )
    delivered = set(deliveries)
    kept = {
        key
        for (key,) in pair.rows(
            "SELECT key FROM django_idempotency_record WHERE key = ANY(%s)", keys
        )
    }
    per_charge = Counter(
        count
        for (count,) in pair.rows(
            "SELECT count(l.id) FROM payments_charge c "
            "LEFT JOIN payments_ledgerentry l ON l.charge_id = c.id GROUP BY c.id"
        )
    )
    per_charge_settlements = Counter(
        count
        for (count,) in pair.rows(
            "SELECT count(s.id) FROM payments_charge c "
            "LEFT JOIN payments_settlement s ON s.charge_id = c.id GROUP BY c.id"
        )
    )
    return {
        "charges answered 2xx": answered,
        "answered, record on the new primary": len(kept),
        "charges": pair.count("SELECT count(*) FROM payments_charge"),
        "captures at the processor": run.captures(),
        "ledger rows": pair.count("SELECT count(*) FROM payments_ledgerentry"),
        "consumer records": pair.count(
            "SELECT count(*) FROM django_idempotency_record WHERE scope LIKE 'consumer:%%'"
        ),
        "settlements": pair.count("SELECT count(*) FROM payments_settlement"),
        "settlements per charge": dict(per_charge_settlements),
        # The processor's webhook answered 2xx, by a primary whose commit was then lost: the
        # sender does not deliver it again (past its one extra delivery).
        "settled, then lost": run.settlements_lost(),
        "outbox rows": pair.count("SELECT count(*) FROM django_idempotency_outbox"),
        "ledger rows per charge": dict(per_charge),
        # Published before a failover whose new primary lacks the message's transaction,
        # and never written again there under the same id.
        "ids delivered to the worker": len(delivered),
        "delivered, not in the final outbox": len(delivered - outbox),
        # Published twice under one id: by a run whose commit the failover lost, then by the
        # retry's run on the new primary (or a redelivery: Redis' visibility timeout).
        "ids delivered more than once": sum(1 for n in deliveries.values() if n > 1),
        "failovers": pair.failovers,
        "attempts": dict(sum((client.attempts for client in clients), Counter())),
    }


def publish_latencies(run: Chain, charges: int) -> list[float]:
    """Seconds from each charge's outbox row written to its publish (the database's clock),
    for ``charges`` charges sent one after another, each once the one before was published."""
    client = Client(run.web.url, run.headers, charges, time.monotonic() + 60)
    since = run.pair.rows("SELECT now()")[0][0]

    def published() -> list[float]:
        return [latency for (latency,) in run.pair.rows(PUBLISHED, since)]

    for sent in range(1, charges + 1):
        client.charge(str(uuid.uuid4()))
        wait_for(lambda n=sent: len(published()) >= n, timeout=30, every=0.02)
    return published()


def beat_since(run: Chain) -> bool:
    query = "SELECT count(*) FROM django_idempotency_relay_heartbeat WHERE beat_at > %s"
    return run.pair.count(query, run.pair.promoted_at) > 0


def probed(run: Chain, django_db_blocker: Any) -> Fact:
    """The probe's replication line, as an app server on the current primary reports it."""
    with django_db_blocker.unblock(), run.pair.primary.django_connection(DATABASE) as connection:
        return replication(connection)


@pytest.mark.timeout(150)
def test_a_synchronous_failover_under_retried_traffic_loses_nothing_and_doubles_nothing(
    subprocess_env: dict[str, str], tmp_path: Path, django_db_blocker: Any
) -> None:
    with chain(subprocess_env, tmp_path, synchronous=True) as run:
        before = probed(run, django_db_blocker)
        clients = run.traffic(clients=6, charges=4, fail_over_after=[8])
        after = probed(run, django_db_blocker)
        assert [client.error for client in clients] == [None] * 6
        answered = sum(len(client.answered) for client in clients)
        run.settled(answered)
        figures = outcome(run, clients, answered)
        # The relay beats on the new primary: its heartbeat (what operators watch) came back.
        wait_for(partial(beat_since, run), timeout=20, every=0.2)
        # And a commit on the new primary wakes it (NOTIFY: it LISTENs there), not only its
        # poll. It wakes every BEAT_EVERY (5 s: its heartbeat, the redrive's check) whatever
        # IDEMPOTENCY_OUTBOX_POLL_INTERVAL says; by polling alone a charge sent once the one
        # before was published, just after a wake, waits for the next: 30 s for six (seen
        # with a relay that never LISTENs again), not 5.
        latencies = publish_latencies(run, 6)
        relay_listening = run.pair.listening()
    figures["seconds from write to publish, after"] = [round(x, 3) for x in latencies]
    print(json.dumps(figures, indent=2))
    assert run.pair.failovers == 1 and answered == 24
    assert (before.verdict, before.value) == (
        "pass",
        "synchronous (1 of 1 standbys, synchronous_commit on)",
    )
    # The promoted standby has none of its own.
    assert (after.verdict, after.value) == ("info", "no streaming standby")
    assert figures["answered, record on the new primary"] == answered
    counts = ("charges", "captures at the processor", "ledger rows", "consumer records")
    for count in (*counts, "settlements"):
        assert figures[count] == answered, (count, figures)
    assert figures["ledger rows per charge"] == {1: answered}
    assert figures["settlements per charge"] == {1: answered}
    assert len(latencies) == 6 and sum(latencies) < BEAT_EVERY, latencies
    assert relay_listening == 1


# The longer runs (a CI cell of their own): 240 charges, three failovers at random points
# with a new standby made after each; and one failover after the asynchronous standby
# received nothing for 1 s while the primary went on answering (a slow network), so that
# commits are lost. Their figures are in docs/deployment.md ("Failover").
@pytest.mark.profile
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("synchronous", "lag"),
    [(True, 0.0), (False, 0.0), (False, 1.0)],
    ids=["synchronous", "asynchronous", "asynchronous-lagging"],
)
def test_failovers_under_retried_traffic(
    subprocess_env: dict[str, str], tmp_path: Path, synchronous: bool, lag: float
) -> None:
    # At random points of the traffic (the seed is printed with the figures).
    seed = random.randrange(2**32)
    points = random.Random(seed)
    after = [points.randrange(40, 160)] if lag else sorted(points.sample(range(20, 220), 3))
    with chain(subprocess_env, tmp_path, synchronous=synchronous, lags=bool(lag)) as run:
        clients = run.traffic(clients=8, charges=30, fail_over_after=after, timeout=400, lag=lag)
        assert [client.error for client in clients] == [None] * 8
        answered = sum(len(client.answered) for client in clients)
        lost = answered - outcome(run, clients, answered)["answered, record on the new primary"]
        run.settled(answered - lost)
        figures = outcome(run, clients, answered) | {"seed": seed, "failed over after": after}
    print(json.dumps(figures, indent=2))
    assert run.pair.failovers == len(after) and answered == 240
    # Each key was captured once: a request that ran again after a lost commit sent the
    # same downstream key, which the processor answered with its first capture.
    assert figures["captures at the processor"] == answered
    # No charge has a second ledger row, and no message left the building under an id the
    # new primary does not know, unless its charge was lost after its answer.
    assert set(figures["ledger rows per charge"]) <= {1}
    # No charge is settled twice, however often the processor delivered its webhook.
    assert set(figures["settlements per charge"]) <= {0, 1}
    if synchronous:
        assert lost == 0 and figures["delivered, not in the final outbox"] == 0
        for count in ("charges", "ledger rows", "consumer records", "settlements"):
            assert figures[count] == answered, (count, figures)
    else:
        assert figures["delivered, not in the final outbox"] <= lost
        assert figures["charges"] == figures["ledger rows"] == answered - lost
        # A charge unsettled is one whose settlement the failover lost after its webhook was
        # answered (the sender does not deliver it again); the run reports how many.
        unsettled = figures["charges"] - figures["settlements"]
        assert unsettled == figures["settled, then lost"], figures
