"""The deployment probe's views in process: who may use them, what a run writes, what the
report says of the test database. Over real app servers: tests/scenarios/test_probe.py."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord, ProbeRow
from django_idempotency.probe.facts import secret_fingerprint, server_facts

RUN, REPORT = "/idempotency/probe/run/", "/idempotency/probe/report/"
TOKEN = "probe-token-for-tests"
BEARER = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("probe_token")]


@pytest.fixture
def probe_token(settings: Any) -> None:
    settings.IDEMPOTENCY_PROBE_TOKEN = TOKEN


def run(client: Client, key: str, **headers: str) -> Any:
    return client.post(
        RUN,
        {},
        content_type="application/json",
        headers={**BEARER, "Idempotency-Key": key, **headers},
    )


def facts(using: str = "default") -> dict[str, Any]:
    return {fact.name: fact for fact in server_facts(using)}


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Token {TOKEN}"}],
    ids=["none", "wrong token", "other scheme"],
)
def test_without_the_token_neither_view_answers(client: Client, headers: dict[str, str]) -> None:
    assert client.get(REPORT, headers=headers).status_code == 403
    response = client.post(
        RUN, {}, content_type="application/json", headers={**headers, "Idempotency-Key": "k"}
    )
    assert response.status_code == 403
    assert not ProbeRow.objects.exists()


def test_without_a_token_setting_nothing_runs_and_the_403_says_how(
    client: Client, settings: Any
) -> None:
    settings.IDEMPOTENCY_PROBE_TOKEN = None

    response = client.post(
        RUN, {}, content_type="application/json", headers={"Authorization": "Bearer "}
    )

    assert response.status_code == 403
    assert "Set IDEMPOTENCY_PROBE_TOKEN" in response.json()["detail"]


def test_a_staff_user_reads_the_report_but_cannot_run(client: Client, admin_user: Any) -> None:
    client.force_login(admin_user)

    assert client.get(REPORT).status_code == 200
    assert client.post(RUN, {}, headers={"Idempotency-Key": "k"}).status_code == 403


def test_a_run_writes_one_row_and_its_retry_is_replayed(client: Client) -> None:
    key = f"probe-{uuid.uuid4()}"

    first, retry = run(client, key), run(client, key)

    assert first.status_code == retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert ProbeRow.objects.filter(key=key).count() == 1
    assert client.get(REPORT, {"key": key}, headers=BEARER).json()["executions"] == 1


def test_a_run_needs_a_key(client: Client) -> None:
    response = client.post(RUN, {}, content_type="application/json", headers=BEARER)

    assert response.status_code == 400
    assert not ProbeRow.objects.exists()


def test_old_probe_rows_go_on_the_next_run(client: Client, settings: Any) -> None:
    settings.IDEMPOTENCY_MAX_TTL = timedelta(hours=1)
    old = ProbeRow.objects.create(key="old", server="s")
    ProbeRow.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(hours=2))
    recent = ProbeRow.objects.create(key="recent", server="s")

    run(client, f"probe-{uuid.uuid4()}")

    assert not ProbeRow.objects.filter(pk=old.pk).exists()
    assert ProbeRow.objects.filter(pk=recent.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_the_report_passes_on_the_test_database(client: Client) -> None:
    body = client.get(REPORT, headers=BEARER).json()

    verdicts = {fact["name"]: fact["verdict"] for fact in body["facts"]}
    assert verdicts["isolation"] == "pass"
    assert verdicts["clock skew against the database"] == "pass"
    assert verdicts["partitions ahead"] == "pass"
    assert verdicts["pooler"] == "pass"
    assert verdicts["outbox backlog"] == "pass"
    assert "fail" not in verdicts.values(), body
    assert {fact["value"] for fact in body["facts"] if fact["name"] == "lock secret"} == {
        secret_fingerprint("default")
    }


@pytest.mark.django_db
def test_the_lock_secrets_fingerprint_follows_the_secret() -> None:
    shared = secret_fingerprint("default")
    with override_settings(IDEMPOTENCY_SECRET_KEY="one"):
        one = secret_fingerprint("default")
    with override_settings(IDEMPOTENCY_SECRET_KEY="two"):
        two = secret_fingerprint("default")

    assert len({shared, one, two}) == 3
    assert "one" not in one and len(one) == 16


@pytest.mark.django_db(transaction=True)
def test_a_secret_key_that_is_not_the_databases_fails_the_lock_secret_fact(
    client: Client,
) -> None:
    with override_settings(IDEMPOTENCY_SECRET_KEY="a secret of this server's own"):
        body = client.get(REPORT, headers=BEARER).json()
    fact = next(fact for fact in body["facts"] if fact["name"] == "lock secret")
    assert fact["verdict"] == "fail", fact
    assert "IDEMPOTENCY_SECRET_KEY" in fact["detail"] and "database" in fact["detail"]


@pytest.mark.django_db(transaction=True)
def test_a_session_at_repeatable_read_fails_the_isolation_fact(settings: Any) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    try:
        fact = facts()["isolation"]
    finally:
        connection.close()

    assert (fact.verdict, fact.value) == ("fail", "repeatable read")
    assert "READ COMMITTED" in fact.detail


def test_an_outbox_message_older_than_its_max_age_fails_the_backlog_fact(settings: Any) -> None:
    from django_idempotency.models import OutboxMessage

    settings.IDEMPOTENCY_OUTBOX_MAX_AGE = timedelta(minutes=5)
    OutboxMessage.objects.create(
        id=uuid.uuid4(), created_at=timezone.now() - timedelta(minutes=6), kind=0, name="t"
    )

    fact = facts()["outbox backlog"]

    assert fact.verdict == "fail"
    assert "idempotency_relay" in fact.detail


def test_an_old_dead_letter_is_no_backlog_but_a_warning_of_its_own(settings: Any) -> None:
    # One rule with W120 and the backlog gauge: a dead letter waits for an operator, not for
    # a relay, so the probe counts it apart (W121) and never fails the backlog on it.
    from django_idempotency.models import OutboxMessage

    settings.IDEMPOTENCY_OUTBOX_MAX_AGE = timedelta(minutes=5)
    OutboxMessage.objects.create(
        id=uuid.uuid4(),
        created_at=timezone.now() - timedelta(minutes=6),
        dead_at=timezone.now(),
        kind=0,
        name="t",
    )

    found = facts()

    assert (found["outbox backlog"].verdict, found["outbox backlog"].value) == ("pass", "empty")
    assert found["system check django_idempotency.W121"].verdict == "warn"


# The probe header on the project's own views: their checks run, the view does not.

PROBED = {"Idempotency-Probe": TOKEN, "Idempotency-Key": "probe-k"}


@pytest.mark.urls("tests.support.urls")
def test_a_probe_request_to_a_view_runs_its_checks_not_the_view(
    client: Client, make_token_user: Any
) -> None:
    from tests.support.views import CALLS

    user = make_token_user()
    before = CALLS[f"iban:{user.user.pk}"]

    response = client.post(
        "/iban/below-token-required/", {}, content_type="application/json",
        headers={**PROBED, **user.headers},
    )  # fmt: skip

    assert response.status_code == 204
    assert response.headers["Idempotency-Probe"] == "passed"
    assert CALLS[f"iban:{user.user.pk}"] == before
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.urls("tests.support.urls")
def test_a_probe_request_to_a_view_that_claims_before_authentication_is_refused(
    client: Client, make_token_user: Any
) -> None:
    user = make_token_user()

    response = Client(raise_request_exception=False).post(
        "/iban/above-token-required/", {}, content_type="application/json",
        headers={**PROBED, **user.headers},
    )  # fmt: skip

    assert response.status_code == 500
    assert response.json()["type"].endswith("misconfigured")
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.urls("tests.support.urls")
@pytest.mark.parametrize("token", ["wrong", None], ids=["wrong token", "no token setting"])
def test_without_the_probe_token_the_header_changes_nothing(
    client: Client, make_token_user: Any, settings: Any, token: str | None
) -> None:
    if token is None:
        settings.IDEMPOTENCY_PROBE_TOKEN = None
    user = make_token_user()
    headers = {**PROBED, **user.headers, "Idempotency-Probe": token or TOKEN}

    response = client.post(
        "/iban/below-token-required/", {}, content_type="application/json", headers=headers
    )

    assert response.status_code == 200
    assert "Idempotency-Probe" not in response.headers
    assert IdempotencyRecord.objects.count() == 1


# What a probe request meets is what the request would meet (issue 29): the object's
# permissions, the key's stored fingerprint, and whose key it is.


def patch_charge(user: Any, pk: int, key: str, description: str, probe: bool) -> Any:
    headers = {**user.headers, "Idempotency-Key": key}
    if probe:
        headers["Idempotency-Probe"] = TOKEN
    return Client().patch(
        f"/api/charges/{pk}/", {"description": description},
        content_type="application/json", headers=headers,
    )  # fmt: skip


def test_a_probe_runs_the_views_object_permissions(make_token_user: Any) -> None:
    from testproject.payments.models import Charge

    alice, bob = make_token_user("alice"), make_token_user("bob")
    charge = Charge.objects.create(amount=2499, currency="inr", user=alice.user)

    bobs = patch_charge(bob, charge.pk, new_key(), "mine now", probe=True)
    alices = patch_charge(alice, charge.pk, new_key(), "hers", probe=True)

    assert bobs.status_code == 403  # as Bob's real PATCH is answered
    assert "Idempotency-Probe" not in bobs.headers
    assert alices.status_code == 204 and alices.headers["Idempotency-Probe"] == "passed"
    assert alices.headers["Idempotency-Probe-Principal"] == "identified"
    charge.refresh_from_db()
    assert charge.description == ""
    assert not IdempotencyRecord.objects.exists()


def test_a_probe_with_a_key_stored_for_another_request_is_answered_422(
    make_token_user: Any,
) -> None:
    from testproject.payments.models import Charge

    alice = make_token_user("alice")
    charge = Charge.objects.create(amount=2499, currency="inr", user=alice.user)
    key = new_key()
    assert patch_charge(alice, charge.pk, key, "first", probe=False).status_code == 200

    reused = patch_charge(alice, charge.pk, key, "another body", probe=True)
    same = patch_charge(alice, charge.pk, key, "first", probe=True)

    assert reused.status_code == 422
    assert reused.json()["type"].endswith("key-reused")
    assert same.status_code == 204  # the retry of the stored request: a real one replays
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@pytest.mark.urls("tests.support.urls")
def test_a_probe_says_when_a_view_claims_under_the_anonymous_principal(client: Client) -> None:
    headers = {**PROBED, "Idempotency-Key": new_key(), "X-Api-Key": "alice-key"}
    opted_in = client.post(
        "/plain/anonymous-keys/", {}, content_type="application/json", headers=headers
    )
    refused = Client(raise_request_exception=False).post(
        "/plain/identified/", {}, content_type="application/json", headers=headers
    )
    assert opted_in.status_code == 204
    assert opted_in.headers["Idempotency-Probe-Principal"] == "anonymous"
    assert refused.status_code == 500 and refused.json()["type"].endswith("misconfigured")


def new_key() -> str:
    return f"probe-test-{uuid.uuid4()}"


@pytest.mark.parametrize(
    ("principal", "credentials", "verdict"),
    [("anonymous", {"X-Api-Key": "k"}, "fail"), ("anonymous", {}, "pass"),
     ("identified", {"X-Api-Key": "k"}, "pass")],
)  # fmt: skip
def test_the_probe_fails_an_endpoint_that_claims_as_anonymous_although_it_sent_credentials(
    monkeypatch: pytest.MonkeyPatch, principal: str, credentials: dict[str, str], verdict: str
) -> None:
    from django_idempotency.probe import drive

    class Answered:
        status = 204
        headers = {"Idempotency-Probe": "passed", "Idempotency-Probe-Principal": principal}

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(drive.urllib.request, "urlopen", lambda *a, **k: Answered())
    fact = drive._endpoint("http://app/idempotency/probe/", "/api/x/", TOKEN, credentials, 5)
    assert fact.verdict == verdict
    if verdict == "fail":
        assert "X-Api-Key" in fact.detail and "principal callable" in fact.detail


def test_the_replication_line_says_when_nothing_streams_from_the_database() -> None:
    fact = facts()["replication"]
    # The test database has no standby (tests/scenarios/test_replica.py and test_failover.py
    # report an asynchronous and a synchronous one).
    assert (fact.verdict, fact.value) == ("info", "no streaming standby")
