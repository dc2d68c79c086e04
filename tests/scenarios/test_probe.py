"""The deployment probe through real app servers: ``manage.py idempotency_probe`` against two
gunicorns behind PgBouncer in transaction pooling mode passes; against the money-grade
misconfigurations (a database at REPEATABLE READ, two servers with two lock secrets, a
pooler with server-side cursors on) it fails, naming the line, and exits 1."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import ROOT, GunicornServer
from tests.support.servers import PgBouncer, database_name, with_options

TOKEN = "probe-token-for-the-probe-tests"
PROBE = "/idempotency/probe/"

pytestmark = pytest.mark.django_db(transaction=True)

Servers = Callable[..., contextlib.AbstractContextManager[GunicornServer]]


def run_probe(
    env: dict[str, str], *urls: str, duplicates: int = 12, extra: tuple[str, ...] = ()
) -> tuple[int, dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, "manage.py", "idempotency_probe", *urls, "--json",
         "--duplicates", str(duplicates), "--timeout", "60", *extra],
        cwd=ROOT, env={**env, "IDEMPOTENCY_PROBE_TOKEN": TOKEN}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


def verdicts(report: dict[str, Any]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for line in report["lines"]:
        found.setdefault(line["name"], set()).add(line["verdict"])
    return found


@contextlib.contextmanager
def app_servers(gunicorn_server: Servers, *envs: dict[str, str]) -> Iterator[list[str]]:
    """One gunicorn (2 sync workers) per environment, each with the probe token."""
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                gunicorn_server(workers=2, env={"IDEMPOTENCY_PROBE_TOKEN": TOKEN, **env})
            )
            for env in envs
        ]
        yield [server.url + PROBE for server in servers]


def test_two_app_servers_behind_pgbouncer_pass(
    gunicorn_server: Servers,
    pgbouncer: PgBouncer,
    test_database_url: str,
    subprocess_env: dict[str, str],
) -> None:
    pooled = {
        "DATABASE_URL": pgbouncer.url(database_name(test_database_url)),
        "DATABASE_POOLING": "transaction",
    }
    with app_servers(gunicorn_server, pooled, pooled) as urls:
        code, report = run_probe(subprocess_env, *urls)

    assert code == 0, report
    assert report["passed"] is True
    found = verdicts(report)
    for name in ("isolation", "one lock secret", "answers", "executions in the database"):
        assert found[name] == {"pass"}, (name, report)
    executions = [line for line in report["lines"] if line["name"] == "executions in the database"]
    assert [line["value"] for line in executions] == ["1"]
    poolers = {line["value"] for line in report["lines"] if line["name"] == "pooler"}
    assert poolers == {
        "transaction pooling (a session's transactions ran on two server connections)"
    }
    # Each server was asked for its facts: two reports, each with its own process.
    assert len([line for line in report["lines"] if line["name"] == "server"]) == 2


def test_a_database_at_repeatable_read_fails(
    gunicorn_server: Servers, test_database_url: str, subprocess_env: dict[str, str]
) -> None:
    isolated = with_options(test_database_url, "-c default_transaction_isolation=repeatable\\ read")
    with app_servers(gunicorn_server, {"DATABASE_URL": isolated}) as urls:
        code, report = run_probe(subprocess_env, *urls)

    assert code == 1
    found = verdicts(report)
    assert found["isolation"] == {"fail"}
    assert found["answers"] == {"fail"}  # the claim refuses: 500 misconfigured
    answers = next(line for line in report["lines"] if line["name"] == "answers")
    assert "misconfigured" in answers["detail"]
    assert found["executions in the database"] == {"fail"}  # none


def test_two_lock_secrets_fail(gunicorn_server: Servers, subprocess_env: dict[str, str]) -> None:
    with app_servers(
        gunicorn_server, {"IDEMPOTENCY_SECRET_KEY": "one"}, {"IDEMPOTENCY_SECRET_KEY": "two"}
    ) as urls:
        code, report = run_probe(subprocess_env, *urls)

    assert code == 1
    line = next(line for line in report["lines"] if line["name"] == "one lock secret")
    assert line["verdict"] == "fail"
    assert "IDEMPOTENCY_SECRET_KEY" in line["detail"]


def test_transaction_pooling_with_server_side_cursors_fails(
    gunicorn_server: Servers,
    pgbouncer: PgBouncer,
    test_database_url: str,
    subprocess_env: dict[str, str],
) -> None:
    # DATABASE_POOLING=session keeps server-side cursors on, as a project that put PgBouncer in
    # front of its database without changing its settings would have them.
    pooled = {
        "DATABASE_URL": pgbouncer.url(database_name(test_database_url)),
        "DATABASE_POOLING": "session",
    }
    with app_servers(gunicorn_server, pooled) as urls:
        code, report = run_probe(subprocess_env, *urls)

    pooler = next(line for line in report["lines"] if line["name"] == "pooler")
    assert (code, pooler["verdict"]) == (1, "fail"), report
    assert "DISABLE_SERVER_SIDE_CURSORS" in pooler["detail"]


@pytest.fixture(scope="module")
def views_probe(gunicorn_server: Servers) -> Iterator[str]:
    """The probe URL of one gunicorn serving the test-only views, among them @idempotent
    above @api_view (E014) and views open to
    anonymous clients that did not opt in to their keys (E017: /plain/identified/, ...), for the
    tests below: they only read from it."""
    with app_servers(
        gunicorn_server, {"DJANGO_SETTINGS_MODULE": "tests.support.views_settings"}
    ) as urls:
        yield urls[0]


def test_a_decorator_above_a_views_authentication_fails_the_system_checks(
    views_probe: str, subprocess_env: dict[str, str]
) -> None:
    code, report = run_probe(subprocess_env, views_probe, duplicates=4)

    assert code == 1
    failed = {line["name"] for line in report["lines"] if line["verdict"] == "fail"}
    assert failed == {
        "system check django_idempotency.E014",
        "system check django_idempotency.E017",
    }, report


def test_a_plain_view_with_idempotent_above_its_authentication_fails_its_endpoint_line(
    views_probe: str, subprocess_env: dict[str, str], make_token_user: Any
) -> None:
    user = make_token_user()
    extra = (
        "--endpoint", "/iban/above-token-required/",
        "--endpoint", "/iban/below-token-required/",
        "--header", f"Authorization: Token {user.token}",
    )  # fmt: skip
    code, report = run_probe(subprocess_env, views_probe, duplicates=4, extra=extra)

    endpoints = {line["name"]: line for line in report["lines"] if line["name"].startswith("end")}
    assert code == 1
    above = endpoints["endpoint /iban/above-token-required/"]
    assert above["verdict"] == "fail" and "misconfigured" in above["detail"], above
    assert endpoints["endpoint /iban/below-token-required/"]["verdict"] == "pass"


def test_without_the_token_the_probe_fails_at_once(
    gunicorn_server: Servers, subprocess_env: dict[str, str]
) -> None:
    with gunicorn_server(workers=1) as server:  # no IDEMPOTENCY_PROBE_TOKEN on the server
        code, report = run_probe(subprocess_env, server.url + PROBE, duplicates=2)

    assert code == 1
    assert verdicts(report)["reached"] == {"fail"}
