"""The reliability suite's chain-short profile (``tests/reliability/chain_run.py``), run once
for this module: charges captured at the fake processor and posted to the ledger through the
outbox, while gunicorn workers, relays and Celery workers are killed and the broker and
PostgreSQL restarted, then the end-to-end invariant; and once more with the ledger message on
a three-node NATS JetStream cluster, a node killed and started again. The chain profile,
minutes long, is a command (README, "Reliability").

The checks of the invariant are also fed stores that break it, one way at a time: each must
report the violation it exists for.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.reliability.broker_log import BrokerLog, replay
from tests.reliability.chain_checks import (
    GIVEN_BACK,
    ChainState,
    Delivery,
    check_chain,
    figures,
)
from tests.reliability.chain_destinations import DESTINATIONS
from tests.reliability.checks import DUPLICATE, NO_COMMIT, OTHER
from tests.reliability.postgres import explicit_server_url
from tests.reliability.profiles import (
    CHAIN_FAULT_KINDS,
    FAULT_KINDS,
    PROFILES,
    TASK_FAULT_KINDS,
)
from tests.reliability.report import Report
from tests.reliability.run import run
from tests.support.chain_processes import QUEUE, UNACKED

CHARGES = "charges committed"
CHAIN_CHECK = (
    "every charge: one capture, one outbox row, one ledger row; every outbox row "
    "published and delivered; every task result names its ledger row"
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    result = run(PROFILES["chain-short"], server_url=explicit_server_url())
    markdown, _ = result.write(tmp_path_factory.mktemp("reliability") / "chain-short.md")
    print(markdown.read_text())
    return result


# The run ----------------------------------------------------------------------------------

# About 20 s on two shared cores (half a minute when they are busy); leave it room.
run_timeout = pytest.mark.timeout(300)
# A fault profile: out of the README's command, in one CI cell (pyproject's markers).
pytestmark = pytest.mark.profile


@run_timeout
def test_every_charge_answered_2xx_was_captured_once_and_posted_once(report: Report) -> None:
    chain = report.chain
    answered = chain["charges answered 2xx (logical requests)"]
    assert answered >= 15, chain
    assert report.unresolved == 0 and report.final_outcomes.get("never sent", 0) == 0
    # Every logical request ended 2xx, so every charge committed was answered, and each has
    # one capture, one outbox row and one ledger row (chain_checks.py, per charge): a message
    # kombu's Redis transport lost (a worker killed as it took it) was published again, by
    # the relay's redrive or by a relay killed before it marked the message.
    assert chain[CHARGES] == answered
    assert chain["captures at the processor"] == answered
    assert chain["ledger rows"] == answered
    assert (
        chain["lost messages delivered again by another publish"]
        == chain["dropped messages no worker received (lost)"]
    )
    assert report.duplicates == 0, report.violations
    assert report.other_violations == 0, report.violations
    assert [c.name for c in report.checks if c.passed is False] == [], report.checks
    assert report.passed


@run_timeout
def test_every_outbox_row_was_published_and_the_queue_drained(report: Report) -> None:
    chain = report.chain
    assert chain["outbox rows"] == chain["outbox rows published"] == chain[CHARGES]
    assert report.check("after recovery, the outbox is drained and the queue empty").passed
    assert report.check(CHAIN_CHECK).passed is not None


@run_timeout
def test_every_kind_of_fault_was_injected(report: Report) -> None:
    named = DESTINATIONS["celery-redis"].fault_kinds()
    for kind in (*FAULT_KINDS, *(named[kind] for kind in CHAIN_FAULT_KINDS)):
        assert report.faults.get(kind, 0) > 0, report.faults
    for kind in TASK_FAULT_KINDS:
        assert report.kinds.get(kind, 0) > 0, report.kinds
    assert report.faults["task crash: its process killed mid-task"] > 0
    assert report.faults["task crash after commit: its process killed before ack"] > 0
    assert report.faults["crash_once: worker exited after writing"] > 0
    assert report.chain["relays started again after a kill"] > 0
    assert report.chain["Celery workers started again after a kill"] > 0


@run_timeout
def test_the_faults_made_second_publishes_deliveries_and_captures_that_were_absorbed(
    report: Report,
) -> None:
    chain = report.chain
    # A relay died between publish and mark: its rows went out again, under the same id.
    assert chain["relays killed between publish and mark"] > 0
    assert chain["outbox rows published more than once"] > 0
    assert chain["publishes the broker accepted"] > chain[CHARGES]
    # Workers killed after their commit: the broker redelivered, the record answered.
    assert chain[GIVEN_BACK] > 0
    assert chain["deliveries flagged redelivered"] > 0
    assert chain["deliveries answered from the consumer record (already ran)"] > 0
    # Requests re-executed after a crash sent the same downstream key: replayed, not captured.
    assert chain["captures answered by the processor as a replay (same downstream key)"] > 0


@run_timeout
def test_logs_carry_no_key_or_credential(report: Report) -> None:
    assert report.check("logs carry no whole key, credential or request body").passed
    assert report.leaks == 0, report.violations


@run_timeout
def test_on_a_nats_jetstream_cluster_a_node_killed_under_traffic_loses_and_doubles_nothing(
    tmp_path: Path,
) -> None:
    # The same short profile with the ledger message on a stream replicated on three
    # nats-server nodes, one of them killed and started again (about 35 s; the chain profile
    # on it, 4.5 minutes, is a command: docs/reliability-report.md).
    destination = DESTINATIONS["nats-cluster"]
    missing = destination.missing()
    if missing:
        pytest.skip(f"needs {missing}")
    profile = PROFILES["chain-short"]
    assert profile.chain is not None
    chain_shape = dataclasses.replace(profile.chain, destination=destination.name)
    result = run(dataclasses.replace(profile, chain=chain_shape), server_url=explicit_server_url())
    markdown, _ = result.write(tmp_path / "chain-short-nats-cluster.md")
    print(markdown.read_text())
    chain = result.chain
    answered = chain["charges answered 2xx (logical requests)"]
    assert answered >= 15, chain
    for count in (CHARGES, "captures at the processor", "ledger rows", "outbox rows published"):
        assert chain[count] == answered, (count, chain)
    assert result.faults.get("broker-restart", 0) > 0, result.faults
    assert result.duplicates == 0 and result.other_violations == 0, result.violations
    assert result.passed, [c for c in result.checks if c.passed is False]


# The checks -------------------------------------------------------------------------------

MESSAGE, OTHER_MESSAGE = "0190-a", "0190-b"


def sound() -> ChainState:
    """One charge (id 7, amount 1001) captured once, enqueued once, posted once, delivered."""
    return ChainState(
        charges={7: 1001},
        captures=Counter({1001: 1}),
        outbox={MESSAGE: (7, True)},
        ledger={70: (7, MESSAGE)},
        results={MESSAGE: 70},
        deliveries=[Delivery(MESSAGE, "tag-1", False)],
        broker=BrokerLog(kept=True),
    )


def violations(state: ChainState) -> list[tuple[str, str]]:
    return [(v.kind, v.what) for v in check_chain(state).violations]


def test_a_sound_chain_has_no_violation() -> None:
    state = sound()
    # Published twice and delivered three times, posted once: at least once is the promise.
    state.deliveries += [Delivery(MESSAGE, "tag-2", False), Delivery(MESSAGE, "tag-2", True)]
    assert violations(state) == []


def test_a_second_capture_is_a_duplicate() -> None:
    state = sound()
    state.captures[1001] = 2
    assert violations(state) == [(DUPLICATE, "more than one capture at the processor")]


def test_a_charge_without_its_capture_ledger_row_or_outbox_row_is_reported() -> None:
    state = sound()
    state.captures.clear()
    state.outbox.clear()
    state.ledger.clear()
    state.results.clear()
    assert violations(state) == [
        (OTHER, "no capture at the processor"),
        (OTHER, "no outbox row"),
        (OTHER, "no ledger row"),
    ]


def test_a_second_ledger_row_or_outbox_row_is_a_duplicate() -> None:
    state = sound()
    state.outbox[OTHER_MESSAGE] = (7, True)
    state.ledger[71] = (7, OTHER_MESSAGE)
    state.deliveries.append(Delivery(OTHER_MESSAGE, "tag-3", False))
    assert violations(state) == [
        (DUPLICATE, "more than one outbox row"),
        (DUPLICATE, "more than one ledger row"),
    ]


def test_a_capture_for_a_charge_that_never_committed_is_reported() -> None:
    state = sound()
    state.captures[1002] = 1
    assert violations(state) == [(OTHER, "capture without a committed charge")]


def test_an_outbox_row_never_published_or_never_delivered_is_reported() -> None:
    state = sound()
    state.outbox[MESSAGE] = (7, False)
    assert violations(state) == [(OTHER, "outbox row never published")]
    state = sound()
    state.deliveries.clear()
    assert violations(state) == [(OTHER, "published outbox row never delivered")]


def test_rows_that_point_nowhere_are_reported() -> None:
    state = sound()
    state.outbox[OTHER_MESSAGE] = (8, True)
    state.deliveries.append(Delivery(OTHER_MESSAGE, "tag-3", False))
    assert violations(state) == [(OTHER, "outbox row without its charge")]
    state = sound()
    state.ledger[70] = (7, OTHER_MESSAGE)
    assert violations(state) == [
        (OTHER, "ledger row from no outbox message"),
        (OTHER, NO_COMMIT),
    ]


def test_a_stored_task_result_without_its_ledger_row_is_a_2xx_without_a_commit() -> None:
    state = sound()
    state.results[MESSAGE] = 71
    assert violations(state) == [(OTHER, NO_COMMIT)]


def test_a_message_the_broker_dropped_without_its_ledger_row_is_a_violation() -> None:
    # The redrive publishes such a message again: a missing row is never excused.
    state = sound()
    state.ledger.clear()
    state.results.clear()
    state.deliveries.clear()
    state.broker.dropped["tag-1"] = MESSAGE
    assert violations(state) == [
        (OTHER, "no ledger row"),
        (OTHER, "message the broker lost, never delivered again"),
    ]


def test_a_dropped_message_its_worker_received_is_not_lost() -> None:
    # The broker was killed before the worker's record of it arrived; the worker ran it.
    state = sound()
    state.broker.dropped["tag-1"] = MESSAGE
    assert violations(state) == []
    assert figures(state)["dropped messages no worker received (lost)"] == 0


def test_a_lost_message_another_publish_delivered_is_recovered() -> None:
    state = sound()
    state.broker.dropped["tag-0"] = MESSAGE  # its first publish, lost; tag-1 delivered it
    assert violations(state) == []
    assert figures(state)["dropped messages no worker received (lost)"] == 1
    assert figures(state)["lost messages delivered again by another publish"] == 1


def test_a_dead_letter_is_a_violation_none_is_caused_on_purpose() -> None:
    state = sound()
    state.outbox[MESSAGE] = (7, False)
    state.dead.add(MESSAGE)
    assert violations(state) == [(OTHER, "outbox row dead-lettered")]
    assert figures(state)["outbox dead letters"] == 1


def test_where_the_processor_settles_each_charge_is_settled_exactly_once() -> None:
    state = sound()
    state.settlements = Counter({7: 1})
    assert violations(state) == [] and figures(state)["settlements"] == 1
    state.settlements[7] = 2
    assert violations(state) == [(DUPLICATE, "more than one settlement")]
    state.settlements.clear()
    assert violations(state) == [(OTHER, "no settlement")]


def test_without_a_broker_log_its_figures_are_left_out_not_zero() -> None:
    # RabbitMQ keeps no log to replay: what the deliveries show is still counted.
    state = sound()
    state.broker = BrokerLog()
    state.deliveries += [Delivery(MESSAGE, "1", True)]
    counted = figures(state)
    assert "publishes the broker accepted" not in counted
    assert "dropped messages no worker received (lost)" not in counted
    assert counted["deliveries flagged redelivered"] == 1
    assert counted["outbox rows delivered more than once"] == 1
    assert violations(state) == []


def test_a_row_marked_published_and_never_delivered_is_reported() -> None:
    # Say, a relay that marked a row it never published: nothing shows it in the broker.
    state = sound()
    state.ledger.clear()
    state.results.clear()
    state.deliveries.clear()
    assert violations(state) == [
        (OTHER, "no ledger row"),
        (OTHER, "published outbox row never delivered"),
    ]


def test_the_broker_log_replay_finds_a_message_taken_and_never_recorded(tmp_path: Path) -> None:
    def resp(*parts: str) -> bytes:
        items = [p.encode() for p in parts]
        return b"*%d\r\n" % len(items) + b"".join(b"$%d\r\n%s\r\n" % (len(i), i) for i in items)

    def message(task: str, tag: str) -> str:
        return json.dumps({"headers": {"id": task}, "properties": {"delivery_tag": tag}})

    commands = [
        resp("LPUSH", QUEUE, message("m1", "t1")),
        resp("LPUSH", QUEUE, message("m2", "t2")),
        resp("RPOP", QUEUE),  # m1, recorded: delivered, then given back by a restore
        resp("MULTI"),
        resp("HSET", UNACKED, "t1", "[]"),
        resp("EXEC"),
        resp("HDEL", UNACKED, "t1"),
        resp("RPUSH", QUEUE, message("m1", "t1")),
        resp("RPOP", QUEUE),  # m1 again, recorded
        resp("HSET", UNACKED, "t1", "[]"),
        resp("RPOP", QUEUE),  # m2, never recorded: dropped
        resp("LPUSH", QUEUE, message("m3", "t3"))[:-9],  # cut short by a kill
    ]
    (tmp_path / "appendonly.aof.1.incr.aof").write_bytes(b"".join(commands))
    log = replay(tmp_path)
    assert log.dropped == {"t2": "m2"}
    assert log.given_back == 1
    assert (log.publishes("m1"), log.publishes("m2"), log.publishes("m3")) == (1, 1, 0)


# The command line ----------------------------------------------------------------------


def test_destination_is_for_chain_profiles_and_each_one_is_described(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tests.reliability.__main__ import main
    from tests.reliability.profiles import ChainShape

    with pytest.raises(SystemExit) as refused:
        main(["--profile", "short", "--destination", "celery-rabbitmq"])
    assert refused.value.code == 2
    assert "--destination is for a chain profile (chain, chain-short), not short" in (
        capsys.readouterr().err
    )
    assert {"celery-redis", "celery-rabbitmq", "nats", "nats-cluster", "tasks-rq"} <= set(
        DESTINATIONS
    )
    assert PROFILES["chain-short"].chain == ChainShape(
        fault_every=(0.3, 0.7), broker_down_seconds=(0.2, 0.6), drain_timeout=90.0
    )  # the suite's own: Celery on Redis, no settlements
    described = ChainShape(destination="celery-rabbitmq", settle=True).describe()
    assert (
        "destination celery-rabbitmq: Celery workers (prefork) on a private RabbitMQ" in described
    )
    assert "settling each capture by its signed webhook" in described


def test_a_destination_without_its_server_or_module_is_refused_naming_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.reliability import __main__ as command

    def refusal(destination: str) -> str:
        with pytest.raises(SystemExit) as refused:
            command.main(["--profile", "chain-short", "--destination", destination])
        assert refused.value.code == 2
        return capsys.readouterr().err

    with monkeypatch.context() as without_servers:
        without_servers.setattr(shutil, "which", lambda name: None)
        # Without Debian's nats-server, that is what the destination requires.
        without_servers.setitem(
            DESTINATIONS,
            "nats",
            dataclasses.replace(DESTINATIONS["nats"], requires="nats-server"),
        )
        assert "--destination nats needs nats-server" in refusal("nats")
        assert "--destination tasks-rq needs redis-server" in refusal("tasks-rq")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *args: None if name in {"nats", "django_tasks_rq"} else find_spec(name, *args),
    )  # fmt: skip
    if shutil.which("redis-server"):
        assert (
            "--destination tasks-rq needs the Python module django_tasks_rq (pip install "
            "django-tasks-rq" in refusal("tasks-rq")
        )
    if DESTINATIONS["nats"].requires != "nats-server":  # installed
        assert "--destination nats needs the Python module nats (pip install " in refusal("nats")
