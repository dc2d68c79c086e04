"""Two databases behind a tenant router: records must live where the view's writes go.

``testproject.routers.TenantRouter`` sends the models of ``settings.TENANT_APPS`` to the
request's tenant database (``X-Tenant: a``: ``default``, the test database; ``X-Tenant: b``:
``shard``, a second database on the same server). Users and tokens stay in ``default`` (and
are copied to the shard, whose charges reference them).

Two ways projects write such a router, each served by its own gunicorn:

- ``records-follow-tenant``: ``TENANT_APPS=payments,django_idempotency``. The router also
  sends ``IdempotencyRecord`` to the tenant's database, the engine's
  ``router.db_for_write(IdempotencyRecord)`` picks the shard, and the claim, the view's
  writes and the stored response share one transaction there.
- ``app-models-only``: ``TENANT_APPS=payments``. The router knows only the project's models.
  The engine asks it for the database of the view's model (a DRF view's queryset or
  serializer model) or takes the view's ``using`` option (the plain views'
  ``charges_database``), and keeps the records there.

Either way a crash after the write on the second database leaves neither the charge nor the
record, and the retry executes once.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
import pytest
import requests

from testproject.payments import executions
from testproject.payments.models import Charge
from tests.conftest import GunicornServer, TokenUser
from tests.support.client import honouring_retry_after, replayed
from tests.support.payments import CHARGE, send_at_once
from tests.support.servers import count, private_database


@pytest.fixture(scope="module")
def shard_url(
    test_database_url: str,
    subprocess_env: dict[str, str],
    cleanup_in_background: Callable[[Callable[[], object]], None],
) -> Iterator[str]:
    """A second database on the test database's server, migrated like ``default``; dropped
    in the background after the module's tests (the drop waits for a checkpoint)."""
    with private_database(
        test_database_url,
        "_shard",
        lambda url: {**subprocess_env, "SHARD_DATABASE_URL": url},
        cleanup_in_background,
        "--database",
        "shard",
    ) as url:
        yield url


def serve(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
    shard_url: str,
    tenant_apps: str,
) -> contextlib.AbstractContextManager[GunicornServer]:
    env = {"SHARD_DATABASE_URL": shard_url, "TENANT_APPS": tenant_apps}
    return gunicorn_server(workers=2, threads=2, env=env)


@pytest.fixture(scope="module")
def records_follow_tenant(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
    shard_url: str,
) -> Iterator[GunicornServer]:
    with serve(gunicorn_server, shard_url, "payments,django_idempotency") as server:
        yield server


@pytest.fixture(scope="module")
def app_models_only(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
    shard_url: str,
) -> Iterator[GunicornServer]:
    with serve(gunicorn_server, shard_url, "payments") as server:
        yield server


@dataclass(frozen=True)
class Tenants:
    """A live server behind the tenant router, and a user known to both databases."""

    server: GunicornServer
    default_url: str
    shard_url: str
    user: Any

    def post(
        self, tenant: str, key: str, body: dict[str, Any], path: str = "/api/charges/"
    ) -> requests.Response:
        return requests.post(
            self.server.url + path,
            json=body,
            headers={**self.user.headers, "Idempotency-Key": key, "X-Tenant": tenant},
            timeout=30,
        )

    def database(self, tenant: str) -> str:
        return {"a": self.default_url, "b": self.shard_url}[tenant]

    def charges(self, tenant: str) -> int:
        return count(
            self.database(tenant),
            "SELECT count(*) FROM payments_charge WHERE user_id = %s",
            self.user.user.pk,
        )

    def records(self, tenant: str, key: str) -> int:
        return count(
            self.database(tenant),
            "SELECT count(*) FROM django_idempotency_record WHERE key = %s",
            key,
        )


@pytest.fixture(
    params=[
        "records_follow_tenant",
        "app_models_only",
    ]
)
def tenants(
    request: pytest.FixtureRequest,
    shard_url: str,
    test_database_url: str,
    live_user: TokenUser,
) -> Tenants:
    server = request.getfixturevalue(request.param)
    user = live_user
    # Shared tables are copied to every shard, as sharded projects do.
    with psycopg.connect(shard_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO auth_user (id, password, is_superuser, username, first_name, "
            "last_name, email, is_staff, is_active, date_joined) "
            "VALUES (%s, '!', false, %s, '', '', '', false, true, now())",
            [user.user.pk, user.user.username],
        )
    return Tenants(server, test_database_url, shard_url, user)


def test_each_tenant_s_charges_and_records_live_in_its_database(tenants: Tenants) -> None:
    keys = {"a": str(uuid.uuid4()), "b": str(uuid.uuid4())}

    answers = {tenant: tenants.post(tenant, key, CHARGE) for tenant, key in keys.items()}
    replays = {tenant: tenants.post(tenant, key, CHARGE) for tenant, key in keys.items()}

    for tenant, other in [("a", "b"), ("b", "a")]:
        assert (answers[tenant].status_code, replayed(answers[tenant])) == (201, False), (
            tenants.server.log_text()[-3000:]
        )
        assert replayed(replays[tenant])
        assert replays[tenant].content == answers[tenant].content
        assert (tenants.charges(tenant), tenants.charges(other)) == (1, 1)
        assert tenants.records(tenant, keys[tenant]) == 1
        assert tenants.records(other, keys[tenant]) == 0


@pytest.mark.parametrize("path", ["/api/charges/", "/api/charges-django/"])
def test_a_crash_after_the_write_rolls_back_charge_and_claim_on_the_shard(
    tenants: Tenants, path: str
) -> None:
    key = str(uuid.uuid4())
    body = {**CHARGE, "crash_once": str(uuid.uuid4())}
    before = executions.count(Charge)

    # The worker dies after writing the charge: no reply, no exception handler, no rollback
    # but the server's own when the connection drops.
    with pytest.raises(requests.ConnectionError):
        tenants.post("b", key, body, path)
    after_failure = (tenants.charges("b"), tenants.records("b", key))
    retry = honouring_retry_after(lambda: tenants.post("b", key, body, path))
    replay = tenants.post("b", key, body, path)

    assert after_failure == (0, 0)
    assert (retry.status_code, replayed(retry)) == (201, False), retry.text
    assert (replay.status_code, replayed(replay), replay.content) == (201, True, retry.content)
    assert executions.count(Charge) == (before or 0) + 2
    assert (tenants.charges("b"), tenants.records("b", key)) == (1, 1)
    assert (tenants.charges("a"), tenants.records("a", key)) == (0, 0)


def test_parallel_duplicates_on_the_shard_execute_once(tenants: Tenants) -> None:
    key = str(uuid.uuid4())
    before = executions.count(Charge)

    answers = send_at_once([partial(tenants.post, "b", key, CHARGE)] * 12)

    statuses = Counter((a.status_code, replayed(a)) for a in answers)
    assert set(statuses) <= {(201, False), (201, True), (409, False)}, statuses
    assert statuses[(201, False)] == 1, statuses
    assert executions.count(Charge) == (before or 0) + 1
    assert (tenants.charges("b"), tenants.records("b", key)) == (1, 1)
    assert tenants.records("a", key) == 0
