"""The demo payments app itself: validation, authentication, counts, fault switches and its
commands. What it proves about idempotency over real HTTP is in test_e2e_payments.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import requests
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from testproject.payments import executions
from testproject.payments.faults import InjectedFault, first_sighting
from testproject.payments.models import Charge, FaultTag, Refund
from testproject.payments.serializers import ChargeSerializer
from testproject.payments.views import create_payment
from tests.conftest import unmeasured
from tests.project.test_quickstart import check_the_quickstart_transcripts

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
CHARGE = {"amount": 2499, "currency": "inr"}
CREATE_ENDPOINTS = ["/api/charges/", "/api/refunds/", "/api/charges-plain/"]


def counts(client: APIClient, path: str = "/api/charges/count/") -> tuple[int, int]:
    answer = client.get(path)
    assert answer.status_code == 200
    return answer.json()["executions"], answer.json()["rows"]


@pytest.mark.parametrize("path", CREATE_ENDPOINTS)
def test_create_answers_201_with_the_payment(
    api_client: APIClient, token_user: Any, path: str
) -> None:
    answer = api_client.post(path, {"amount": 2499, "currency": "INR"}, format="json")

    assert answer.status_code == 201, answer.content
    payment = answer.json()
    # A charge also has a description (its owner may PATCH it later); a refund has none.
    extra = set() if path == "/api/refunds/" else {"description"}
    assert set(payment) == {"id", "amount", "currency", "user", "created", *extra}
    assert (payment["amount"], payment["currency"]) == (2499, "inr")
    assert payment["user"] == token_user.user.username
    model = Refund if path == "/api/refunds/" else Charge
    assert model.objects.get(pk=payment["id"]).user == token_user.user


@pytest.mark.parametrize("path", CREATE_ENDPOINTS)
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"amount": 0, "currency": "inr"}, "amount"),
        ({"amount": -2499, "currency": "inr"}, "amount"),
        ({"amount": "lots", "currency": "inr"}, "amount"),
        ({"currency": "inr"}, "amount"),
        ({"amount": 2499, "currency": "rupees"}, "currency"),
        ({"amount": 2499, "currency": "₹₹₹"}, "currency"),
    ],
)
def test_invalid_payment_is_400_and_writes_nothing(
    api_client: APIClient, path: str, body: dict[str, Any], field: str
) -> None:
    answer = api_client.post(path, body, format="json")

    assert answer.status_code == 400
    assert field in answer.json()
    assert Charge.objects.count() + Refund.objects.count() == 0


@pytest.mark.parametrize("path", [*CREATE_ENDPOINTS, "/api/charges-django/"])
def test_absurdly_deep_json_is_400_not_500(api_client: APIClient, path: str) -> None:
    answer = api_client.post(
        path,
        b"[" * 100_000 + b"]" * 100_000,
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()),
    )

    assert answer.status_code == 400


@pytest.mark.parametrize("path", [*CREATE_ENDPOINTS, "/api/charges-django/"])
def test_creating_needs_a_valid_token(anon_client: APIClient, path: str) -> None:
    anonymous = anon_client.post(path, CHARGE, format="json")
    anon_client.credentials(HTTP_AUTHORIZATION="Token " + "z" * 40)
    wrong_token = anon_client.post(path, CHARGE, format="json")

    assert (anonymous.status_code, wrong_token.status_code) == (401, 401)
    assert Charge.objects.count() + Refund.objects.count() == 0


def test_count_endpoint_counts_every_run_and_the_committed_rows(api_client: APIClient) -> None:
    executions_before, rows_before = counts(api_client)
    refunds_before = counts(api_client, "/api/refunds/count/")

    api_client.post("/api/charges/", CHARGE, format="json")
    api_client.post("/api/charges-plain/", CHARGE, format="json")
    api_client.post("/api/charges/", {**CHARGE, "amount": 0}, format="json")
    api_client.raise_request_exception = False
    api_client.post("/api/charges/", {**CHARGE, "fail": "500"}, format="json")

    # Four runs of the charge handler, two of them wrote; the refund counter did not move.
    assert counts(api_client) == (executions_before + 4, rows_before + 2)
    assert counts(api_client, "/api/refunds/count/") == refunds_before


def test_execution_counter_is_not_rolled_back() -> None:
    before = executions.count(Charge)
    assert before is not None

    with pytest.raises(RuntimeError), transaction.atomic():
        executions.record(Charge)
        raise RuntimeError

    assert executions.count(Charge) == before + 1


def test_fault_fields_pass_payment_validation(api_client: APIClient) -> None:
    answer = api_client.post("/api/charges/", {**CHARGE, "delay_ms": 1}, format="json")

    assert answer.status_code == 201
    assert "delay_ms" not in answer.json()


@pytest.mark.parametrize(
    "switch", [{"fail": "sometimes"}, {"delay_ms": -1}, {"delay_ms": 3_600_000}]
)
def test_invalid_fault_switch_is_400(api_client: APIClient, switch: dict[str, Any]) -> None:
    answer = api_client.post("/api/charges/", {**CHARGE, **switch}, format="json")

    assert answer.status_code == 400
    assert set(answer.json()) == set(switch)
    assert Charge.objects.count() == 0


@pytest.mark.parametrize("fail", ["500", "500r", "after_write", "sometimes"])
def test_fault_switches_do_nothing_unless_enabled(api_client: APIClient, fail: str) -> None:
    with override_settings(PAYMENTS_FAULTS_ENABLED=False):
        answer = api_client.post("/api/charges-plain/", {**CHARGE, "fail": fail}, format="json")

    assert answer.status_code == 201
    assert Charge.objects.count() == 1


@pytest.mark.parametrize(
    ("fail", "status", "rows"), [("500", 500, 0), ("500r", 500, 1), ("after_write", 500, 1)]
)
def test_fail_switch_on_the_unprotected_baseline(
    api_client: APIClient, fail: str, status: int, rows: int
) -> None:
    # Without the mixin nothing rolls back: what the handler wrote before failing stays.
    api_client.raise_request_exception = False

    answer = api_client.post("/api/charges-plain/", {**CHARGE, "fail": fail}, format="json")

    assert answer.status_code == status
    assert Charge.objects.count() == rows


@pytest.mark.django_db(transaction=True)
def test_fail_once_raises_only_the_first_time(token_user: Any) -> None:
    body = {**CHARGE, "fail_once": str(uuid.uuid4())}

    with pytest.raises(InjectedFault), transaction.atomic():
        create_payment(ChargeSerializer(data=body), token_user.user)
    status, charge = create_payment(ChargeSerializer(data=body), token_user.user)

    assert status == 201
    assert list(Charge.objects.values_list("pk", flat=True)) == [charge["id"]]


@pytest.mark.django_db(transaction=True)
def test_first_sighting_survives_the_rollback_of_the_request() -> None:
    tag = str(uuid.uuid4())

    with pytest.raises(RuntimeError), transaction.atomic():
        assert first_sighting(tag)
        raise RuntimeError

    assert not first_sighting(tag)
    assert FaultTag.objects.filter(tag=tag).count() == 1


def test_seed_demo_creates_alice_and_bob_and_can_run_again() -> None:
    User = get_user_model()
    bob = User.objects.create(username="bob")
    Token.objects.create(user=bob, key="c" * 40)

    for _ in range(2):
        call_command("seed_demo", stdout=StringIO())

    assert dict(Token.objects.values_list("user__username", "key")) == {
        "alice": "a" * 40,
        "bob": "b" * 40,
    }
    assert set(User.objects.values_list("username", flat=True)) == {"alice", "bob", "admin"}
    assert not User.objects.get(username="alice").has_usable_password()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + "b" * 40)
    assert client.post("/api/charges/", CHARGE, format="json").json()["user"] == "bob"


def test_seed_demo_creates_the_demo_admin_once_and_restores_its_password(client: Any) -> None:
    User = get_user_model()
    call_command("seed_demo", stdout=StringIO())
    admin = User.objects.get(username="admin")
    admin.set_password("changed")
    admin.is_superuser = False
    admin.save()

    out = StringIO()
    call_command("seed_demo", stdout=out)

    assert User.objects.filter(username="admin").count() == 1
    admin.refresh_from_db()
    assert admin.is_staff and admin.is_superuser and admin.check_password("demo-admin")
    assert "admin password demo-admin" in out.getvalue()
    assert client.login(username="admin", password="demo-admin")
    assert client.get("/admin/django_idempotency/idempotencyrecord/").status_code == 200


def test_models_match_migrations() -> None:
    call_command("makemigrations", "payments", "--check", "--dry-run", stdout=StringIO())


@pytest.mark.django_db(transaction=True)
def test_migrations_reverse_to_zero_and_back() -> None:
    def sequences() -> set[str]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT relname FROM pg_class WHERE relkind = 'S'")
            return {name for (name,) in cursor.fetchall()}

    expected = {executions.sequence_name(Charge), executions.sequence_name(Refund)}
    assert expected <= sequences()
    try:
        call_command("migrate", "payments", "zero", verbosity=0)
        assert not expected & sequences()
        assert "payments_charge" not in connection.introspection.table_names()
    finally:
        call_command("migrate", "payments", verbosity=0)
    assert expected <= sequences()


@pytest.mark.django_db(transaction=True)
def test_demo_smoke_runs_the_readme_requests_against_gunicorn(
    subprocess_env: dict[str, str],
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    demo = subprocess.run(
        [sys.executable, "manage.py", "demo", "--smoke", "--workers", "2", "--port", str(port)],
        cwd=ROOT,
        # Not traced by coverage.py: the demo runs the testproject's code and starts servers
        # and workers whose measurements are lost (conftest.unmeasured); what the library
        # does for it, the test processes cover.
        env=unmeasured(subprocess_env),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert f"Admin: http://127.0.0.1:{port}/admin/ (user admin, password demo-admin" in demo.stdout
    assert "HTTP 201, Idempotent-Replayed: true" in demo.stdout
    assert "HTTP 422" in demo.stdout
    assert "Smoke test passed: one new charge, executed once, replayed on retry." in demo.stdout
    assert f"curl -i -X POST http://127.0.0.1:{port}/api/charges/" in demo.stdout
    assert Charge.objects.filter(user__username="alice").count() == 1


def test_a_second_smoke_run_says_its_own_charge_apart_from_earlier_ones() -> None:
    from testproject.payments.management.commands.demo import smoke_passed

    assert smoke_passed(1).strip() == (
        "Smoke test passed: one new charge, executed once, replayed on retry."
    )
    assert "one new charge (1 from earlier runs, 2 in all)" in smoke_passed(2)


@pytest.mark.django_db(transaction=True)
def test_demo_serves_the_api_the_quickstart_transcripts_and_its_styled_admin_until_stopped(
    subprocess_env: dict[str, str],
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    demo = subprocess.Popen(
        # Two sync workers (the demo's own 4 start too slowly on a busy 2-core machine):
        # the quickstart's in-progress answer needs a second one. The test project's
        # settings, as the demo runs, not the tests'.
        [sys.executable, "manage.py", "demo", "--workers", "2", "--port", str(port)],
        cwd=ROOT,
        env={**unmeasured(subprocess_env), "DJANGO_SETTINGS_MODULE": "testproject.settings"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert demo.stdout is not None
        printed = []
        for line in demo.stdout:
            printed.append(line)
            if "Ctrl-C stops the server" in line:
                break
        output = "".join(printed)
        assert f"Admin: {base}/admin/ (user admin, password demo-admin" in output
        login = requests.get(f"{base}/admin/login/", timeout=10)
        stylesheet = requests.get(f"{base}/static/admin/css/base.css", timeout=10)
        count = requests.get(f"{base}/api/charges/count/", timeout=10)
        assert login.status_code == 200 and "/static/admin/css/base.css" in login.text
        assert stylesheet.status_code == 200
        assert count.status_code == 200
        check_the_quickstart_transcripts(base)
    finally:
        demo.terminate()  # SIGTERM stops gunicorn with the demo
        code = demo.wait(timeout=60)

    assert code == 0
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{base}/api/charges/count/", timeout=5)


@pytest.mark.parametrize("mode", [[], ["--smoke"]], ids=["serve", "smoke"])
def test_demo_with_its_port_taken_fails_naming_the_port_and_the_option(
    subprocess_env: dict[str, str], mode: list[str]
) -> None:
    # Another server listening on the port: the demo must neither serve "next to" it nor
    # run its smoke test against it.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        demo = subprocess.run(
            [sys.executable, "manage.py", "demo", *mode, "--port", str(port)],
            cwd=ROOT,
            env=unmeasured(subprocess_env),
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert demo.returncode != 0
    assert f"port {port} is taken" in demo.stderr
    assert f"--port {port + 1}" in demo.stderr
    assert "Smoke test passed" not in demo.stdout
    assert "Serving" not in demo.stdout


@pytest.mark.django_db(transaction=True)
def test_admin_static_files_are_served_under_gunicorn(live_gunicorn: str) -> None:
    stylesheet = requests.get(live_gunicorn + "/static/admin/css/base.css", timeout=10)
    login = requests.get(live_gunicorn + "/admin/login/", timeout=10)

    assert stylesheet.status_code == 200
    assert stylesheet.headers["Content-Type"].startswith("text/css")
    assert "/static/admin/css/base.css" in login.text


@pytest.mark.django_db
def test_openapi_schema_documents_the_idempotency_key_on_idempotent_endpoints_only(
    client,
) -> None:
    pytest.importorskip("drf_spectacular")
    response = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    paths = json.loads(response.content)["paths"]

    def header_names(path: str) -> set[str]:
        parameters = paths[path]["post"].get("parameters", [])
        return {p["name"] for p in parameters if p["in"] == "header"}

    assert "Idempotency-Key" in header_names("/api/charges/")
    assert "Idempotency-Key" in header_names("/api/refunds/")
    assert "Idempotency-Key" not in header_names("/api/charges-plain/")
    assert "422" in paths["/api/charges/"]["post"]["responses"]


RECEIPT_ENDPOINTS = ["/api/receipts/", "/api/receipts-plain/"]


@pytest.mark.parametrize("path", RECEIPT_ENDPOINTS)
@pytest.mark.parametrize("size", [1024, 100_000, 2 * 1024 * 1024])
def test_receipt_is_exactly_the_size_asked_for(
    api_client: APIClient, token_user: Any, path: str, size: int
) -> None:
    headers = {"Idempotency-Key": str(uuid.uuid4())} if path == "/api/receipts/" else {}
    answer = api_client.post(path, {**CHARGE, "size": size}, format="json", headers=headers)
    assert answer.status_code == 201, answer.content[:300]
    assert len(answer.content) == size
    receipt = json.loads(answer.content)
    charge = Charge.objects.get(pk=receipt["charge"]["id"])
    assert (charge.amount, charge.user_id) == (2499, token_user.user.pk)
    assert receipt["charge"]["currency"] == "inr" and "size" not in receipt["charge"]
    # Whole lines of one width fill it; the padding is less than one more line.
    widths = {len(line) for line in receipt["lines"]}
    assert len(widths) == 1 and len(receipt["padding"]) < widths.pop() + 3
    assert len(set(receipt["lines"])) == len(receipt["lines"])  # not one line repeated


@pytest.mark.parametrize("path", RECEIPT_ENDPOINTS)
@pytest.mark.parametrize("size", [1023, 2 * 1024 * 1024 + 1, "large", None])
def test_receipt_of_an_invalid_size_is_400_and_writes_nothing(
    api_client: APIClient, path: str, size: Any
) -> None:
    data = {**CHARGE} if size is None else {**CHARGE, "size": size}
    headers = {"Idempotency-Key": str(uuid.uuid4())} if path == "/api/receipts/" else {}
    answer = api_client.post(path, data, format="json", headers=headers)
    assert answer.status_code == 400
    assert "size" in answer.json()
    assert not Charge.objects.exists()


def test_receipt_replay_is_byte_identical_with_and_without_deflate(
    api_client: APIClient,
) -> None:
    import zlib

    key = {"Idempotency-Key": str(uuid.uuid4())}
    data = {**CHARGE, "size": 100_000}
    first = api_client.post("/api/receipts/", data, format="json", headers=key)
    assert first.status_code == 201
    again = api_client.post("/api/receipts/", data, format="json", headers=key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    deflated = api_client.post(
        "/api/receipts/", data, format="json", headers={**key, "Accept-Encoding": "deflate"}
    )
    assert deflated.status_code == 201 and deflated.headers["Idempotent-Replayed"] == "true"
    body = deflated.content
    if deflated.headers.get("Content-Encoding") == "deflate":
        body = zlib.decompress(body)
    assert body == first.content
    assert Charge.objects.count() == 1
