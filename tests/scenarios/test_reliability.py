"""The reliability suite's short profile (``tests/reliability``), run once for this module:
every kind of fault, every attack of issue 9 and every deployment shape of issue 22 against
the testproject under gunicorn, back to back, then the invariant. The long profile is a
command (README, "Reliability").

The run uses a database of its own (a private PostgreSQL cluster, or its own database on
the server of an explicit ``DATABASE_URL``), not pytest-django's test database.
"""

from __future__ import annotations

import pytest

from tests.reliability.checks import DUPLICATE, LEAK, OTHER
from tests.reliability.faults import maintenance_available
from tests.reliability.postgres import explicit_server_url
from tests.reliability.profiles import (
    ATTACK_KINDS,
    CLIENT_FAULT_KINDS,
    FAULT_KINDS,
    PROFILES,
    SHAPE_KINDS,
)
from tests.reliability.report import Report
from tests.reliability.run import run

# The run takes about 25 s on two shared cores (40 s when they are busy); leave it room.
# A fault profile: out of the README's command, in one CI cell (pyproject's markers).
pytestmark = [pytest.mark.profile, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    result = run(PROFILES["short"], server_url=explicit_server_url())
    markdown, _ = result.write(tmp_path_factory.mktemp("reliability") / "short.md")
    print(markdown.read_text())
    return result


def failed_checks(report: Report, prefix: str) -> list[str]:
    matching = [c for c in report.checks if c.name.startswith(prefix)]
    assert matching, f"no check named {prefix!r} ran"
    return [f"{c.name}: {c.detail}" for c in matching if c.passed is False]


def violations(report: Report, kind: str | None = None) -> str:
    """The violations found, one a line, each naming its kind of request (its attack or
    deployment shape); pytest would cut a list short."""
    found = [v for v in report.violations if kind is None or v["kind"] == kind]
    return "\n" + "\n".join(f"{v['kind']}, {v['what']}: {v['detail']}" for v in found)


def test_every_key_answered_2xx_has_exactly_one_effect(report: Report) -> None:
    assert report.requests["logical requests"] > 150
    assert report.duplicates == 0, violations(report, DUPLICATE)
    assert report.other_violations == 0, violations(report, OTHER)


def test_no_2xx_without_a_commit(report: Report) -> None:
    assert report.kinds.get("rolled back", 0) > 0
    assert failed_checks(report, "no 2xx without a commit") == []


def test_no_principal_saw_another_principals_response(report: Report) -> None:
    assert report.kinds.get("cross-principal", 0) > 0
    assert report.leaks == 0, violations(report, LEAK)


def test_every_kind_of_fault_was_injected_and_survived(report: Report) -> None:
    for kind in (*FAULT_KINDS, *ATTACK_KINDS, *SHAPE_KINDS):
        assert report.faults.get(kind, 0) > 0, report.faults
    for kind in CLIENT_FAULT_KINDS:
        assert report.kinds.get(kind, 0) > 0, report.kinds
    assert report.faults["crash_once: worker exited after writing"] > 0
    assert report.faults["fail_once: 500 after writing"] > 0
    assert report.outcomes.get("connection-error", 0) + report.outcomes.get("timeout", 0) > 0


def test_every_key_is_answered_after_recovery_and_none_stays_blocked(report: Report) -> None:
    assert report.unresolved == 0, violations(report)
    assert failed_checks(report, "after recovery") == []


def test_store_unreachable_at_start_fails_closed(report: Report) -> None:
    assert failed_checks(report, "store unreachable at start") == []  # 5xx; 503 on DRF views
    assert failed_checks(report, "store back") == []


def test_isolation_across_principals_and_credentials(report: Report) -> None:
    checks = ("one key,", "anonymous", "wrong token", "a key is bound", "@idempotent view")
    assert [failure for prefix in checks for failure in failed_checks(report, prefix)] == []


def test_rolled_back_work_is_a_500_and_leaves_the_key_free(report: Report) -> None:
    assert failed_checks(report, "rolled-back 2xx") == []


def test_waiting_duplicates_never_take_every_thread(report: Report) -> None:
    assert failed_checks(report, "waiting-duplicate flood") == []


def test_a_forged_lock_key_does_not_block_another_principal(report: Report) -> None:
    # The first check proves the forgery is real (under the old lock id), the second
    # that it no longer blocks.
    assert len(failed_checks(report, "forged lock key")) == 0
    assert len([c for c in report.checks if c.name.startswith("forged lock key")]) == 2


def test_an_oversized_4xx_is_answered_not_stored(report: Report) -> None:
    assert failed_checks(report, "oversized 4xx") == []


def test_multipart_to_a_json_endpoint_is_415_and_stores_nothing(report: Report) -> None:
    assert failed_checks(report, "multipart to a JSON-only endpoint") == []


def test_a_repeatable_read_database_runs_a_key_once_or_refuses_it(report: Report) -> None:
    # The database's default isolation is REPEATABLE READ; duplicates wait on the lock.
    failed = failed_checks(report, "repeatable read database")
    assert not failed, "\n".join(failed)


def test_two_app_servers_with_different_secret_keys_run_a_key_once(report: Report) -> None:
    failed = failed_checks(report, "two app servers, two SECRET_KEYs")
    assert not failed, "\n".join(failed)


def test_idempotent_above_authentication_never_replays_to_another(report: Report) -> None:
    # Alice's charge, then Bob and a client with no credentials with her key and body.
    failed = failed_checks(report, "@idempotent above authentication")
    assert not failed, "\n".join(failed)


def test_hot_key_executes_once(report: Report) -> None:
    assert failed_checks(report, "hot key") == []


def test_distinct_keys_run_in_parallel(report: Report) -> None:
    assert failed_checks(report, "distinct keys") == []


def test_duplicates_arrive_while_partition_maintenance_creates_partitions(report: Report) -> None:
    if not maintenance_available():
        pytest.skip("no idempotency_partitions command in this checkout")
    assert report.faults.get("maintenance: partitions created", 0) > 0, report.faults


def test_logs_stored_headers_and_replays_hold_no_secrets(report: Report) -> None:
    assert failed_checks(report, "logs carry") == []
    assert report.kinds.get("cookie", 0) > 0
    leaked = ("sensitive header stored", "replay carried Set-Cookie")
    assert not [v for v in report.violations if v["what"] in leaked]


def test_admin_escapes_stored_bodies(report: Report) -> None:
    check = report.check("admin escapes stored bodies")
    if check.passed is None:
        pytest.skip(check.detail)
    assert check.passed, check.detail
