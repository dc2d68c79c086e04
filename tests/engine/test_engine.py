"""The engine's contract (sections 1, 3, 5, 7, 8 and the 503), through both glues."""

from __future__ import annotations

import json
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import requests
import zstandard
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connection
from django.test import Client, RequestFactory, override_settings

from django_idempotency.engine.hashing import lock_id
from django_idempotency.engine.waiting import waiter_limit
from django_idempotency.http.request import prefer_wait
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import bodies, records
from tests.factories import ScriptFactory, UserFactory, new_key
from tests.support.claims import held_claim, unreachable_store
from tests.support.client import problem, replayed, send
from tests.support.views import CALLS, Boom, business_rows

pytestmark = pytest.mark.urls("tests.support.urls")

ENDPOINTS = pytest.mark.parametrize("path", ["/drf/", "/plain/"])


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def atomic_requests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run the test with and without ATOMIC_REQUESTS on the default database."""
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", request.param)
    return bool(request.param)


@pytest.fixture(params=[False, True], ids=["zlib_here", "lz4_in_postgres"])
def database_compresses(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run the test both ways bodies can be compressed, whatever this server has: zlib in
    the app, or (pretended where the server has no lz4) PostgreSQL's own."""
    monkeypatch.setattr(bodies, "database_compresses", lambda using: request.param)
    return bool(request.param)


# 1. Which requests are covered


@pytest.mark.django_db
@ENDPOINTS
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_post_and_patch_are_covered_by_default(client, path: str, method: str) -> None:
    key, script = new_key(), ScriptFactory()
    first = send(client, method, path, script, key=key)
    retry = send(client, method, path, script, key=key)
    assert not replayed(first)
    assert replayed(retry)
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1
    assert IdempotencyRecord.objects.filter(key=key, method=method).count() == 1


@pytest.mark.django_db
@ENDPOINTS
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_other_methods_pass_through_untouched(client, path: str, method: str) -> None:
    key, tag = new_key(), new_key()
    first = send(client, method, f"{path}?tag={tag}", key=key)
    second = send(client, method, f"{path}?tag={tag}", key=key)
    assert not replayed(first)
    assert not replayed(second)
    assert first.json()["nonce"] != second.json()["nonce"]
    assert CALLS[tag] == 2
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/put-only/", "/plain/put-only/"])
def test_per_view_methods_replace_the_default(client, path: str) -> None:
    put_key, post_key, script = new_key(), new_key(), ScriptFactory()
    send(client, "PUT", path, script, key=put_key)
    assert replayed(send(client, "PUT", path, script, key=put_key))
    send(client, "POST", path, script, key=post_key)
    assert not replayed(send(client, "POST", path, script, key=post_key))
    assert CALLS[script["tag"]] == 3
    assert list(IdempotencyRecord.objects.values_list("method", flat=True)) == ["PUT"]


@pytest.mark.django_db
@ENDPOINTS
def test_global_methods_setting_replaces_the_default(client, settings, path: str) -> None:
    settings.IDEMPOTENCY_METHODS = ["put"]
    key, script = new_key(), ScriptFactory()
    send(client, "PUT", path, script, key=key)
    assert replayed(send(client, "PUT", path, script, key=key))
    send(client, "POST", path, script, key=new_key())
    assert CALLS[script["tag"]] == 2
    assert IdempotencyRecord.objects.get().method == "PUT"


@pytest.mark.django_db
@ENDPOINTS
def test_request_without_a_key_runs_unprotected_and_writes_no_record(client, path: str) -> None:
    script = ScriptFactory()
    first = send(client, "POST", path, script)
    second = send(client, "POST", path, script)
    assert (first.status_code, second.status_code) == (201, 201)
    assert not replayed(second)
    assert CALLS[script["tag"]] == 2
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/required/", "/plain/required/"])
def test_required_key_missing_is_400_missing_key_and_the_view_does_not_run(
    client, path: str
) -> None:
    script = ScriptFactory()
    response = send(client, "POST", path, script)
    assert response.status_code == 400
    assert problem(response)["type"].endswith("missing-key")
    assert CALLS[script["tag"]] == 0


@pytest.mark.django_db
@ENDPOINTS
def test_global_required_setting_makes_every_covered_view_require_a_key(
    client, settings, path: str
) -> None:
    settings.IDEMPOTENCY_REQUIRED = True
    script = ScriptFactory()
    response = send(client, "POST", path, script)
    assert problem(response)["type"].endswith("missing-key")
    # Methods that are not covered still need no key.
    assert send(client, "GET", f"{path}?tag={script['tag']}").status_code == 201
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/required/", "/plain/required/"])
def test_key_in_the_query_string_or_body_is_never_read(client, path: str) -> None:
    key = new_key()
    script = ScriptFactory(**{"Idempotency-Key": key, "idempotency_key": key})
    query = f"{path}?Idempotency-Key={key}&idempotency_key={key}"
    response = send(client, "POST", query, script)
    assert response.status_code == 400
    assert problem(response)["type"].endswith("missing-key")
    assert CALLS[script["tag"]] == 0


@pytest.mark.django_db
@ENDPOINTS
def test_key_in_the_query_string_or_body_does_not_protect(client, path: str) -> None:
    key = new_key()
    script = ScriptFactory(**{"Idempotency-Key": key})
    send(client, "POST", f"{path}?Idempotency-Key={key}", script)
    second = send(client, "POST", f"{path}?Idempotency-Key={key}", script)
    assert not replayed(second)
    assert CALLS[script["tag"]] == 2
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
@ENDPOINTS
def test_header_name_is_configurable(client, settings, path: str) -> None:
    settings.IDEMPOTENCY_HEADER = "X-Request-Key"
    key, script = new_key(), ScriptFactory()
    send(client, "POST", path, script, headers={"X-Request-Key": key})
    retry = send(client, "POST", path, script, headers={"X-Request-Key": key})
    assert replayed(retry)
    # The default header name is now just another header.
    send(client, "POST", path, script, key=new_key())
    assert CALLS[script["tag"]] == 2


# 3. Scope


@pytest.mark.django_db
@ENDPOINTS
def test_two_users_with_the_same_key_each_execute_and_see_only_their_own(path: str) -> None:
    alice, bob = UserFactory(), UserFactory()
    alice_client, bob_client = Client(), Client()
    alice_client.force_login(alice)
    bob_client.force_login(bob)
    key, script = new_key(), ScriptFactory()

    alice_first = send(alice_client, "POST", path, script, key=key)
    bob_first = send(bob_client, "POST", path, script, key=key)
    alice_retry = send(alice_client, "POST", path, script, key=key)
    bob_retry = send(bob_client, "POST", path, script, key=key)

    assert not replayed(bob_first)
    assert bob_first.json()["nonce"] != alice_first.json()["nonce"]
    assert alice_retry.content == alice_first.content
    assert bob_retry.content == bob_first.content
    assert CALLS[script["tag"]] == 2
    assert set(IdempotencyRecord.objects.values_list("scope", flat=True)) == {
        f"user:{alice.pk}",
        f"user:{bob.pk}",
    }


@pytest.mark.django_db
@ENDPOINTS
def test_a_key_in_flight_for_one_user_never_blocks_another(path: str) -> None:
    alice, bob = UserFactory(), UserFactory()
    alice_client, bob_client = Client(), Client()
    alice_client.force_login(alice)
    bob_client.force_login(bob)
    key, script = new_key(), ScriptFactory()
    no_wait = {"Prefer": "wait=0"}
    with held_claim(f"user:{alice.pk}", key):
        bob_response = send(bob_client, "POST", path, script, key=key, headers=no_wait)
        alice_response = send(alice_client, "POST", path, script, key=key, headers=no_wait)
    assert bob_response.status_code == 201
    assert alice_response.status_code == 409
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
@ENDPOINTS
def test_anonymous_requests_share_one_principal(path: str) -> None:
    key, script = new_key(), ScriptFactory()
    first = send(Client(), "POST", path, script, key=key)
    other = send(Client(), "POST", path, script, key=key)
    assert replayed(other)
    assert other.content == first.content
    assert IdempotencyRecord.objects.get(key=key).scope == "anonymous"


def assert_tenants_are_separate(client: Client, path: str) -> None:
    key, script = new_key(), ScriptFactory()
    acme = send(client, "POST", path, script, key=key, headers={"X-Tenant": "acme"})
    globex = send(client, "POST", path, script, key=key, headers={"X-Tenant": "globex"})
    acme_retry = send(client, "POST", path, script, key=key, headers={"X-Tenant": "acme"})
    assert not replayed(globex)
    assert globex.json()["nonce"] != acme.json()["nonce"]
    assert acme_retry.content == acme.content
    assert CALLS[script["tag"]] == 2
    assert set(IdempotencyRecord.objects.values_list("scope", flat=True)) == {
        "tenant:acme",
        "tenant:globex",
    }


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/tenant/", "/plain/tenant/"])
def test_per_view_principal_callable_scopes_the_keys(client, path: str) -> None:
    assert_tenants_are_separate(client, path)


@pytest.mark.django_db
@ENDPOINTS
def test_global_principal_setting_by_dotted_path_scopes_the_keys(
    client, settings, path: str
) -> None:
    settings.IDEMPOTENCY_PRINCIPAL = "tests.support.views.tenant_principal"
    assert_tenants_are_separate(client, path)


@pytest.mark.django_db
def test_principal_callable_sees_the_drf_authenticated_user(settings, make_token_user) -> None:
    # Token authentication happens in DRF, not in Django's middleware.
    settings.IDEMPOTENCY_PRINCIPAL = lambda request: f"token-user:{request.user.username}"
    alice = make_token_user(username="alice-core")
    key, script = new_key(), ScriptFactory()
    send(alice.client(), "POST", "/drf/", script, key=key)
    assert IdempotencyRecord.objects.get(key=key).scope == "token-user:alice-core"


# 5. One transaction


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_view_raising_after_its_write_commits_nothing_and_the_retry_executes(
    client, path: str, atomic_requests: bool
) -> None:
    key, script = new_key(), ScriptFactory(fail="raise", once=True)
    with pytest.raises(Boom):
        send(client, "POST", path, script, key=key)
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.exists()

    retry = send(client, "POST", path, script, key=key)
    assert retry.status_code == 201
    assert not replayed(retry)
    assert retry.json()["execution"] == 2
    assert business_rows(script["tag"]) == 1
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_view_returning_a_5xx_commits_nothing_and_the_retry_executes(
    client, path: str, atomic_requests: bool
) -> None:
    key, script = new_key(), ScriptFactory(fail="status", fail_status=503, once=True)
    first = send(client, "POST", path, script, key=key)
    assert first.status_code == 503
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.exists()

    retry = send(client, "POST", path, script, key=key)
    assert retry.status_code == 201
    assert not replayed(retry)
    assert business_rows(script["tag"]) == 1


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_success_commits_the_business_write_and_the_record_together(
    client, path: str, atomic_requests: bool
) -> None:
    key, script = new_key(), ScriptFactory()
    response = send(client, "POST", path, script, key=key)
    record = IdempotencyRecord.objects.get(key=key)
    assert business_rows(script["tag"]) == 1
    assert record.status == IdempotencyRecord.Status.COMPLETED
    assert record.response_code == 201
    assert bytes(record.response_body) == response.content


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
@pytest.mark.parametrize(("reject", "status"), [("invalid", 400), ("notfound", 404)])
def test_4xx_outcome_is_stored_and_replayed(
    client, path: str, reject: str, status: int, atomic_requests: bool
) -> None:
    key, script = new_key(), ScriptFactory(reject=reject)
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert first.status_code == status
    assert retry.status_code == status
    assert replayed(retry)
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
@ENDPOINTS
@pytest.mark.parametrize("status", [200, 202, 303, 400, 403, 410, 422])
def test_2xx_3xx_and_4xx_statuses_are_stored(client, path: str, status: int) -> None:
    key, script = new_key(), ScriptFactory(status=status)
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert first.status_code == status
    assert retry.status_code == status
    assert replayed(retry)
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
@pytest.mark.parametrize("status", [408, 409, 425, 429])
def test_unstored_status_leaves_no_record_and_the_retry_executes(
    client, path: str, status: int
) -> None:
    key, script = new_key(), ScriptFactory(status=status)
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert first.status_code == status
    assert not replayed(retry)
    assert CALLS[script["tag"]] == 2
    assert not IdempotencyRecord.objects.exists()
    # Unstored outcomes roll back like a 5xx: the retry runs again, so nothing may stay.
    assert business_rows(script["tag"]) == 0


@pytest.mark.django_db
@ENDPOINTS
def test_unstored_statuses_setting_replaces_the_default(client, settings, path: str) -> None:
    settings.IDEMPOTENCY_UNSTORED_STATUSES = [404]
    not_found, conflict = ScriptFactory(status=404), ScriptFactory(status=409)
    key_404, key_409 = new_key(), new_key()
    send(client, "POST", path, not_found, key=key_404)
    assert not replayed(send(client, "POST", path, not_found, key=key_404))
    send(client, "POST", path, conflict, key=key_409)
    retry_409 = send(client, "POST", path, conflict, key=key_409)
    assert retry_409.status_code == 409
    assert replayed(retry_409)
    assert (CALLS[not_found["tag"]], CALLS[conflict["tag"]]) == (2, 1)


@pytest.mark.django_db
@ENDPOINTS
def test_stripes_validation_behaviour_as_the_quickstart_sets_it(client, settings, path) -> None:
    # docs/quickstart.md, "A validation 400 is an answer too": a 400 stored by default, and
    # with 400 and 422 unstored, a fixed body under the same key runs.
    invalid = ScriptFactory(reject="invalid")
    key = new_key()
    send(client, "POST", path, invalid, key=key)
    assert replayed(send(client, "POST", path, invalid, key=key))
    settings.IDEMPOTENCY_UNSTORED_STATUSES = (400, 408, 409, 422, 425, 429)
    key = new_key()
    assert send(client, "POST", path, invalid, key=key).status_code == 400
    fixed = ScriptFactory()
    response = send(client, "POST", path, fixed, key=key)
    assert response.status_code == 201 and not replayed(response)
    assert CALLS[fixed["tag"]] == 1


# 7. What is stored and replayed


REPLAYED_HEADERS = {
    "Location": "/charges/ch_1",
    "Content-Language": "de",
    "ETag": '"v1"',
    "Link": '</charges/ch_1>; rel="self"',
    "X-Request-Cost": "3",
}


@pytest.mark.django_db
@ENDPOINTS
def test_replay_returns_the_first_status_body_and_allow_listed_headers(
    client, settings, path: str
) -> None:
    settings.IDEMPOTENCY_REPLAY_HEADERS = ["X-Request-Cost"]
    key = new_key()
    script = ScriptFactory(status=202, headers={**REPLAYED_HEADERS, "X-Not-Listed": "1"})
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert retry.status_code == 202
    assert retry.content == first.content
    assert retry["Content-Type"] == first["Content-Type"]
    for name, value in REPLAYED_HEADERS.items():
        assert retry[name] == value
    assert first["X-Not-Listed"] == "1"
    assert "X-Not-Listed" not in retry
    assert retry["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first


@pytest.mark.django_db
@ENDPOINTS
def test_cookies_and_authentication_headers_are_never_stored_even_if_configured(
    client, settings, path: str
) -> None:
    secrets = {
        "Set-Cookie": "raw=secret",
        "WWW-Authenticate": 'Bearer realm="secret"',
        "Authorization": "Bearer secret",
        "Proxy-Authenticate": "Basic secret",
    }
    settings.IDEMPOTENCY_REPLAY_HEADERS = [*secrets, "Cookie"]
    key, script = new_key(), ScriptFactory(headers=secrets, cookie="secret-session")
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert first.cookies["sid"].value == "secret-session"
    assert replayed(retry)
    assert "sid" not in retry.cookies
    for name in secrets:
        assert name not in retry
    record = IdempotencyRecord.objects.get(key=key)
    assert "secret" not in json.dumps(record.response_headers)


@pytest.mark.django_db
@ENDPOINTS
def test_a_hundred_sequential_retries_execute_once_and_replay_byte_identical(
    client, path: str
) -> None:
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", path, script, key=key)
    retries = [send(client, "POST", path, script, key=key) for _ in range(100)]
    assert {(r.status_code, r.content, replayed(r)) for r in retries} == {
        (201, first.content, True)
    }
    assert CALLS[script["tag"]] == 1
    assert business_rows(script["tag"]) == 1


@pytest.mark.django_db
@ENDPOINTS
def test_large_body_is_stored_compressed_and_replayed_byte_identical(
    client, path: str, database_compresses: bool
) -> None:
    key, script = new_key(), ScriptFactory(pad=300_000)
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert len(first.content) > 300_000
    assert retry.content == first.content
    record = IdempotencyRecord.objects.get(key=key)
    if database_compresses:
        # Stored as it is: TOAST compresses it (lz4 where the column has it, else pglz).
        assert record.body_encoding == ""
        assert bytes(record.response_body) == first.content
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_column_size(response_body) FROM django_idempotency_record "
                "WHERE key = %s",
                [key],
            )
            (stored,) = cursor.fetchone()
        assert stored < len(first.content) // 10
    else:
        # zstd where it is installed (the test group has it), else zlib.
        assert record.body_encoding == bodies.compression(None)
        assert len(record.response_body) < len(first.content) // 10


@pytest.mark.django_db
@ENDPOINTS
def test_incompressible_body_is_stored_as_it_is(client, path: str) -> None:
    key, script = new_key(), ScriptFactory(random_bytes=50_000)
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert retry.content == first.content
    assert retry["Content-Type"] == "application/octet-stream"
    record = IdempotencyRecord.objects.get(key=key)
    assert record.body_encoding == ""
    assert bytes(record.response_body) == first.content


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("threshold", "codec", "encoding"),
    [(None, None, ""), (64, "zlib", "zlib"), (64, "zstd", "zstd")],
)
def test_compression_starts_at_compress_min_bytes(
    client, settings, monkeypatch, threshold: int | None, codec: str | None, encoding: str
) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: False)
    settings.IDEMPOTENCY_BODY_COMPRESSION = codec
    if threshold is not None:
        settings.IDEMPOTENCY_COMPRESS_MIN_BYTES = threshold
    key, script = new_key(), ScriptFactory(pad=1024)
    first = send(client, "POST", "/drf/", script, key=key)
    assert IdempotencyRecord.objects.get(key=key).body_encoding == encoding
    assert send(client, "POST", "/drf/", script, key=key).content == first.content


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_streaming_response_fails_loudly_and_commits_nothing(client, path: str) -> None:
    key, script = new_key(), ScriptFactory(stream=True)
    with pytest.raises(ImproperlyConfigured, match="streaming"):
        send(client, "POST", path, script, key=key)
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_response_over_max_response_bytes_fails_loudly_and_commits_nothing(
    client, settings, path: str
) -> None:
    settings.IDEMPOTENCY_MAX_RESPONSE_BYTES = 1000
    key, script = new_key(), ScriptFactory(pad=2000)
    with pytest.raises(ImproperlyConfigured, match="MAX_RESPONSE_BYTES"):
        send(client, "POST", path, script, key=key)
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.exists()


# 8. Retention


def expire(key: str, by: timedelta) -> None:
    """Move a record's expiry ``by`` before its creation (the claim compares both with
    the transaction's clock, which stands still inside a ``db`` test)."""
    record = IdempotencyRecord.objects.get(key=key)
    record.expires_at = record.created_at - by
    record.save(update_fields=["expires_at"])


@pytest.mark.django_db
@ENDPOINTS
def test_record_is_replayable_for_24_hours_by_default(client, path: str) -> None:
    key = new_key()
    send(client, "POST", path, ScriptFactory(), key=key)
    record = IdempotencyRecord.objects.get(key=key)
    assert record.expires_at - record.created_at == timedelta(hours=24)


@pytest.mark.django_db
@ENDPOINTS
def test_after_the_ttl_the_key_is_new(client, path: str) -> None:
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", path, script, key=key)
    expire(key, timedelta(seconds=1))
    again = send(client, "POST", path, script, key=key)
    assert again.status_code == 201
    assert not replayed(again)
    assert again.json()["nonce"] != first.json()["nonce"]
    # ...and the new execution is what later retries get.
    assert send(client, "POST", path, script, key=key).content == again.content
    assert CALLS[script["tag"]] == 2


@pytest.mark.django_db
@ENDPOINTS
def test_after_the_ttl_even_a_different_request_may_use_the_key(client, path: str) -> None:
    key = new_key()
    send(client, "POST", path, ScriptFactory(), key=key)
    expire(key, timedelta(seconds=1))
    assert send(client, "POST", path, ScriptFactory(), key=key).status_code == 201


@pytest.mark.django_db
@ENDPOINTS
def test_late_retry_in_the_expired_window_is_410_then_the_key_is_new(
    client, settings, path: str
) -> None:
    settings.IDEMPOTENCY_EXPIRED_WINDOW = timedelta(hours=1)
    key, script = new_key(), ScriptFactory()
    send(client, "POST", path, script, key=key)
    expire(key, timedelta(minutes=1))
    gone = send(client, "POST", path, script, key=key)
    assert gone.status_code == 410
    assert problem(gone)["type"].endswith("key-expired")
    assert CALLS[script["tag"]] == 1

    expire(key, timedelta(hours=2))
    again = send(client, "POST", path, script, key=key)
    assert again.status_code == 201
    assert not replayed(again)
    assert CALLS[script["tag"]] == 2


def stored_lifetime(client: Client, path: str) -> timedelta:
    """How long a record made by one request through ``path`` is replayable."""
    key = new_key()
    send(client, "POST", path, ScriptFactory(), key=key)
    record = IdempotencyRecord.objects.get(key=key)
    return record.expires_at - record.created_at


@pytest.mark.django_db
def test_global_ttl_setting_sets_the_expiry(client, settings) -> None:
    settings.IDEMPOTENCY_TTL = timedelta(hours=2)
    assert stored_lifetime(client, "/drf/") == timedelta(hours=2)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "max_ttl", "expected"),
    [
        ("/drf/ttl-short/", None, timedelta(hours=1)),
        ("/drf/ttl-long/", None, timedelta(hours=24)),
        ("/drf/ttl-long/", timedelta(hours=48), timedelta(hours=48)),
    ],
)
def test_per_view_ttl_is_bounded_by_max_ttl(
    client, settings, path: str, max_ttl: timedelta | None, expected: timedelta
) -> None:
    if max_ttl is not None:
        settings.IDEMPOTENCY_MAX_TTL = max_ttl
    assert stored_lifetime(client, path) == expected


@pytest.mark.django_db
def test_global_ttl_is_bounded_by_max_ttl(client, settings) -> None:
    settings.IDEMPOTENCY_TTL = timedelta(days=7)
    assert stored_lifetime(client, "/drf/") == timedelta(hours=24)


# 9. The store is unreachable: fail closed


@pytest.mark.django_db
@ENDPOINTS
def test_unreachable_store_is_503_with_retry_after_and_the_view_does_not_run(
    client, settings, path: str
) -> None:
    script = ScriptFactory()
    with unreachable_store(settings):
        response = send(client, "POST", path, script, key=new_key())
    assert response.status_code == 503
    assert problem(response)["type"].endswith("store-unavailable")
    assert int(response["Retry-After"]) >= 1
    assert CALLS[script["tag"]] == 0
    assert business_rows(script["tag"]) == 0


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_a_claim_at_repeatable_read_is_500_misconfigured_and_the_view_does_not_run(
    client, caplog: pytest.LogCaptureFixture, atomic_requests: bool, path: str
) -> None:
    # The session's default is what ALTER DATABASE, ALTER ROLE and libpq's options set.
    key, script = new_key(), ScriptFactory()
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION default_transaction_isolation = 'repeatable read'")
    try:
        refused = send(client, "POST", path, script, key=key)
        unkeyed = send(client, "POST", path, ScriptFactory())
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_isolation")
    assert refused.status_code == 500
    assert problem(refused)["type"].endswith(":misconfigured")
    assert CALLS[script["tag"]] == 0 and business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.exists()
    (error,) = [r for r in caplog.records if r.name == "django_idempotency"]
    assert error.levelname == "ERROR"
    assert "was not run" in error.getMessage() and "tests.support.views." in error.getMessage()
    assert "REPEATABLE READ" in error.getMessage() and "READ COMMITTED" in error.getMessage()
    assert unkeyed.status_code == 201  # only the claim refuses
    # Fixed, the same key runs, once.
    again = send(client, "POST", path, script, key=key)
    assert (again.status_code, CALLS[script["tag"]]) == (201, 1)


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_a_stored_key_at_repeatable_read_is_refused_as_the_claim_refuses_it_never_replayed(
    client, atomic_requests: bool, path: str
) -> None:
    """The lookup that replays in one statement refuses what the claim refuses: a stored key
    is not replayed from a session whose claims could not run."""
    key, script = new_key(), ScriptFactory()
    assert send(client, "POST", path, script, key=key).status_code == 201
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION default_transaction_isolation = 'repeatable read'")
    try:
        retry = send(client, "POST", path, script, key=key)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_isolation")
    assert retry.status_code == 500 and not replayed(retry)
    assert problem(retry)["type"].endswith(":misconfigured")
    assert replayed(send(client, "POST", path, script, key=key))


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_a_server_whose_secret_is_not_the_databases_replays_nothing(client, path: str) -> None:
    """The claim of a server keyed with a secret of its own is refused (its lock would not
    serialise the key); the lookup before it is refused alike, never a replay."""
    key, script = new_key(), ScriptFactory()
    assert send(client, "POST", path, script, key=key).status_code == 201
    with override_settings(IDEMPOTENCY_SECRET_KEY="a secret of this server's own"):
        retry = send(client, "POST", path, script, key=key)
    assert retry.status_code == 500 and not replayed(retry)
    assert problem(retry)["type"].endswith(":misconfigured")
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
@ENDPOINTS
def test_unreachable_store_does_not_affect_requests_without_a_key(
    client, settings, path: str
) -> None:
    script = ScriptFactory()
    with unreachable_store(settings):
        response = send(client, "POST", path, script)
    assert response.status_code == 201
    assert CALLS[script["tag"]] == 1


# Prefer: wait (RFC 7240) parsing; the waiting itself is in test_concurrency and
# test_waiting.


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("wait=5", 5),
        ("respond-async, wait=0", 0),
        ('wait="7"', 7),
        ("handling=lenient; foo=bar, WAIT=3", 3),
        ("wait=-1", None),
        ("wait=soon", None),
        ("wait", None),
        ("return=minimal", None),
        ("", None),
    ],
)
def test_prefer_wait_is_parsed_and_ill_formed_preferences_are_ignored(
    header: str, expected: int | None
) -> None:
    request = RequestFactory().post("/", headers={"Prefer": header} if header else {})
    assert prefer_wait(request.META) == expected


@pytest.mark.django_db
@ENDPOINTS
def test_by_default_a_duplicate_gets_409_at_once_and_its_wait_preference_is_not_applied(
    client, path: str
) -> None:
    key = new_key()
    with held_claim("anonymous", key):
        started = time.monotonic()
        response = send(client, "POST", path, ScriptFactory(), key=key, headers={
            "Prefer": "wait=5"
        })  # fmt: skip
        waited = time.monotonic() - started
    assert response.status_code == 409
    assert response.json()["type"].endswith("in-progress")
    assert int(response.headers["Retry-After"]) >= 1
    # Waiting is opt-in; a client cannot turn it on.
    assert "Preference-Applied" not in response.headers
    assert waited < 4


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_a_stored_key_whose_lock_is_held_for_a_moment_is_replayed_not_409(
    client, test_database_url: str, path: str
) -> None:
    # Another duplicate's claim holds the lock for the moment it takes to find the record: a
    # claim that does not wait finds the lock taken, and must still replay what is stored.
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", path, script, key=key)
    assert first.status_code == 201
    with psycopg.connect(test_database_url) as other:  # its transaction holds the lock
        other.execute(
            "SELECT pg_advisory_xact_lock(1768187245, %s)",
            [lock_id(DEFAULT_DB_ALIAS, "anonymous", key)],
        )
        again = send(client, "POST", path, script, key=key)
    assert (again.status_code, replayed(again)) == (201, True), again.content
    assert again.content == first.content


def limit_on_a_thread() -> int:
    """``waiter_limit()`` as a request thread of a threaded server sees it."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(waiter_limit).result()


@pytest.mark.parametrize(
    ("overrides", "gunicorn_args", "expected"),
    [
        ({}, None, 0),  # the default: no request waits on a thread of its own
        ({"IDEMPOTENCY_MAX_WAITERS": 6}, None, 6),
        ({"IDEMPOTENCY_MAX_WAITERS": 6, "IDEMPOTENCY_SERVER_THREADS": 4}, None, 3),
        ({"IDEMPOTENCY_MAX_WAITERS": 2, "IDEMPOTENCY_SERVER_THREADS": 4}, None, 2),
        ({"IDEMPOTENCY_MAX_WAITERS": 6}, "-w 4 --threads 4", 3),
        ({"IDEMPOTENCY_MAX_WAITERS": 6}, "-w 4", 0),
    ],
)
def test_the_waiter_cap_always_leaves_a_thread_free_where_the_thread_count_is_known(
    monkeypatch, overrides: dict[str, int], gunicorn_args: str | None, expected: int
) -> None:
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    if gunicorn_args is not None:
        monkeypatch.setenv("GUNICORN_CMD_ARGS", gunicorn_args)
    with override_settings(**overrides):
        assert limit_on_a_thread() == expected


def test_a_request_served_on_the_main_thread_never_waits_on_it() -> None:
    # gunicorn's sync worker, uWSGI without threads: the main thread is the only one.
    with override_settings(IDEMPOTENCY_MAX_WAITERS=6, IDEMPOTENCY_SERVER_THREADS=8):
        assert waiter_limit() == 0
        assert limit_on_a_thread() == 6


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_store_lost_after_the_view_ran_is_503_store_unavailable_and_nothing_commits(
    live_server, path: str
) -> None:
    key, script = new_key(), ScriptFactory(lose_connection=True)

    def post() -> requests.Response:
        return requests.post(
            live_server.url + path, data=json.dumps(script), timeout=60,
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )  # fmt: skip

    lost = post()
    assert lost.status_code == 503
    assert lost.headers["Content-Type"] == "application/problem+json"
    assert lost.json()["type"].endswith("store-unavailable")
    assert int(lost.headers["Retry-After"]) >= 1
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.exists()

    retry = post()
    assert retry.status_code == 201
    assert retry.json()["execution"] == 2


@pytest.mark.django_db
@ENDPOINTS
@pytest.mark.parametrize("wait", ["99999999999999999999", "²"])
def test_outlandish_prefer_wait_is_never_a_500(client, path: str, wait: str) -> None:
    # A huge number is capped by IDEMPOTENCY_MAX_WAIT; other digits are ill-formed.
    response = send(client, "POST", path, ScriptFactory(), key=new_key(), headers={
        "Prefer": f"wait={wait}"
    })  # fmt: skip
    assert response.status_code == 201


# Holes found under attack (issue 9): each test failed on the code before its fix.


@pytest.mark.django_db(transaction=True)
@ENDPOINTS
@pytest.mark.parametrize("breaks", ["rollback_only", "swallow_db_error"])
def test_a_2xx_whose_transaction_was_marked_for_rollback_is_a_500_and_the_key_stays_free(
    client, atomic_requests: bool, path: str, breaks: str, caplog: pytest.LogCaptureFixture
) -> None:
    key, script = new_key(), ScriptFactory(**{breaks: True})
    first = send(client, "POST", path, script, key=key)
    assert first.status_code == 500
    assert problem(first)["type"].endswith("rolled-back")
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert any(
        r.levelname == "ERROR" and "marked for rollback" in r.getMessage() for r in caplog.records
    )
    fixed = {**script, breaks: False}
    retry = send(client, "POST", path, fixed, key=key)
    assert retry.status_code == 201
    assert not replayed(retry)
    assert business_rows(script["tag"]) == 1


@pytest.mark.django_db
@ENDPOINTS
def test_caching_headers_are_replayed(client, path: str) -> None:
    key = new_key()
    script = ScriptFactory(
        headers={"Cache-Control": "no-store", "Pragma": "no-cache", "Expires": "0", "Vary": "X-A"}
    )
    send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert replayed(retry)
    assert retry["Cache-Control"] == "no-store"
    assert (retry["Pragma"], retry["Expires"]) == ("no-cache", "0")
    assert "X-A" in retry["Vary"]


@pytest.mark.django_db
def test_a_4xx_larger_than_the_limit_is_answered_but_not_stored(client, settings) -> None:
    settings.IDEMPOTENCY_MAX_STORED_ERROR_BYTES = 10_000
    key, small_key = new_key(), new_key()
    big = ScriptFactory(reject="invalid", pad=20_000)
    first = send(client, "POST", "/drf/", big, key=key)
    assert first.status_code == 400
    assert len(first.content) > 10_000
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert not replayed(send(client, "POST", "/drf/", big, key=key))
    small = ScriptFactory(reject="invalid", pad=100)
    send(client, "POST", "/drf/", small, key=small_key)
    assert replayed(send(client, "POST", "/drf/", small, key=small_key))


@pytest.mark.django_db
@ENDPOINTS
def test_a_durable_block_in_an_idempotent_view_is_a_clear_error_naming_it(client, path) -> None:
    client.raise_request_exception = True
    with pytest.raises(ImproperlyConfigured, match=r"durable=True"):
        send(client, "POST", path, ScriptFactory(durable=True), key=new_key())
    assert not IdempotencyRecord.objects.exists()
    # A keyless request runs in a transaction too (the outbox needs one): the same error.
    with pytest.raises(ImproperlyConfigured, match=r"durable=True"):
        send(client, "POST", path, ScriptFactory(durable=True))


@pytest.mark.django_db
@ENDPOINTS
@pytest.mark.parametrize(
    ("codec", "coding", "other"), [("zlib", "deflate", "zstd"), ("zstd", "zstd", "deflate")]
)
def test_a_compressed_replay_goes_out_as_stored_to_clients_that_accept_its_coding(
    client, path: str, monkeypatch, settings, codec: str, coding: str, other: str
) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: False)
    settings.IDEMPOTENCY_BODY_COMPRESSION = codec
    key, script = new_key(), ScriptFactory(pad=64_000)
    first = send(client, "POST", path, script, key=key)
    plain = send(client, "POST", path, script, key=key)
    encoded = send(
        client, "POST", path, script, key=key, headers={"Accept-Encoding": f"gzip, {coding}"}
    )
    refused = send(
        client, "POST", path, script, key=key, headers={"Accept-Encoding": f"{coding};q=0"}
    )
    # A client that takes only the other coding gets the body decompressed.
    elsewise = send(client, "POST", path, script, key=key, headers={"Accept-Encoding": other})
    assert IdempotencyRecord.objects.get(key=key).body_encoding == codec
    assert plain.content == first.content
    assert "Content-Encoding" not in plain
    assert encoded["Content-Encoding"] == coding
    assert "Accept-Encoding" in encoded["Vary"]
    assert len(encoded.content) < len(first.content) // 10
    if codec == "zlib":
        assert zlib.decompress(encoded.content) == first.content
    else:
        assert zstandard.ZstdDecompressor().decompress(encoded.content) == first.content
    for response in (refused, elsewise):
        assert response.content == first.content
        assert "Content-Encoding" not in response
    assert all(replayed(r) for r in (plain, encoded, refused, elsewise))


@pytest.mark.django_db
def test_a_body_the_database_compresses_goes_out_as_it_is_to_every_client(
    client, monkeypatch
) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: True)
    key, script = new_key(), ScriptFactory(pad=64_000)
    first = send(client, "POST", "/drf/", script, key=key)
    encoded = send(client, "POST", "/drf/", script, key=key, headers={"Accept-Encoding": "deflate"})
    assert replayed(encoded)
    assert "Content-Encoding" not in encoded
    assert encoded.content == first.content


def round_trips(client, path: str, script: dict[str, Any], key: str) -> list[str]:
    """What a request sends, one label per round trip (libpq's trace): statements sent in
    one message are joined by "+"."""
    from bench.round_trips import libpq_trace

    connection.ensure_connection()
    with libpq_trace(connection.connection.pgconn) as trace:
        response = send(client, "POST", path, script, key=key)
    assert response.status_code == 201
    assert len(trace.sent) == trace.round_trips
    return trace.sent


@pytest.mark.django_db(transaction=True)
def test_round_trip_budget_per_mode(client) -> None:
    """Beyond the view's own statements (here one INSERT): a fresh key sends the lookup, the
    claim with its BEGIN, and the store with its COMMIT; a replay only the lookup, outside
    any transaction. With lookup_first off, a fresh key saves the lookup and a replay pays
    for the claim's transaction (BEGIN, the claim, COMMIT): the claim expects a record, read
    in binary."""
    # Read once per process, by the first store: not a cost of every request.
    bodies.database_compresses(connection.alias)
    key, script = new_key(), ScriptFactory()
    fresh = round_trips(client, "/drf/", script, key)
    assert fresh[0] == "lookup"
    assert fresh[1] == "BEGIN+claim"
    assert fresh[2].startswith("INSERT")
    assert fresh[3:] == ["store+COMMIT"]
    assert round_trips(client, "/drf/", script, key) == ["lookup"]
    claim_key = new_key()
    fresh = round_trips(client, "/drf/claim-first/", script, claim_key)
    assert fresh[:2] == ["BEGIN", "claim"] and fresh[3:] == ["store+COMMIT"]
    assert round_trips(client, "/drf/claim-first/", script, claim_key) == [
        "BEGIN",
        "claim",
        "COMMIT",
    ]


@pytest.mark.django_db(transaction=True)
def test_under_atomic_requests_the_claim_alone_answers(client, monkeypatch) -> None:
    """In the request's transaction the lookup would only add a round trip (after its BEGIN,
    before its COMMIT): a replay is the claim's, as with lookup_first off."""
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    bodies.database_compresses(connection.alias)
    key, script = new_key(), ScriptFactory()
    fresh = round_trips(client, "/drf/", script, key)
    replay = round_trips(client, "/drf/", script, key)
    assert "lookup" not in fresh and "lookup" not in replay
    assert replay[0] == "BEGIN" and "claim" in replay and replay[-1] == "COMMIT"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("random_bytes", [0, records.BINARY_BODY_MIN_BYTES], ids=["hex", "binary"])
def test_the_store_and_the_commit_travel_in_one_round_trip(client, random_bytes: int) -> None:
    from psycopg.pq import TransactionStatus

    from tests.support.claims import traced_stores

    bodies.database_compresses(connection.alias)  # read once per process, not traced here
    with traced_stores() as stores:
        send(client, "POST", "/drf/", ScriptFactory(random_bytes=random_bytes), key=new_key())
    [(trace, status)] = stores
    assert trace.statements == ["SELECT", "COMMIT"]
    assert trace.sent == ["store+COMMIT"]
    assert trace.round_trips == 1
    # Committed by that round trip: Django's own commit() then costs none.
    assert status == TransactionStatus.IDLE


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/tenant/", "/plain/tenant/"])
def test_past_the_per_principal_bound_a_4xx_is_answered_but_not_stored(
    client, settings, path: str, caplog
) -> None:
    settings.IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE = 3
    tenant, other = {"X-Tenant": new_key()}, {"X-Tenant": new_key()}
    keys = [new_key() for _ in range(5)]
    invalid = [ScriptFactory(reject="invalid") for _ in keys]
    for key, script in zip(keys, invalid, strict=True):
        assert send(client, "POST", path, script, key=key, headers=tenant).status_code == 400
    stored = set(IdempotencyRecord.objects.values_list("key", flat=True))
    assert stored == set(keys[:3])
    # Past the bound the key stays free: its retry runs again (a 4xx has no effect).
    retry = send(client, "POST", path, invalid[4], key=keys[4], headers=tenant)
    assert retry.status_code == 400 and not replayed(retry)
    assert CALLS[invalid[4]["tag"]] == 2
    assert replayed(send(client, "POST", path, invalid[0], key=keys[0], headers=tenant))
    # A 2xx is stored whatever the count, and another principal has a bound of its own.
    ok_key, ok = new_key(), ScriptFactory()
    send(client, "POST", path, ok, key=ok_key, headers=tenant)
    assert replayed(send(client, "POST", path, ok, key=ok_key, headers=tenant))
    theirs = new_key()
    send(client, "POST", path, ScriptFactory(reject="invalid"), key=theirs, headers=other)
    assert IdempotencyRecord.objects.filter(key=theirs).exists()
    warnings = [r for r in caplog.records if "MAX_STORED_ERRORS_PER_MINUTE" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.django_db
def test_without_a_bound_every_4xx_is_stored(client, settings) -> None:
    settings.IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE = None
    tenant = {"X-Tenant": new_key()}
    for _ in range(150):
        send(client, "POST", "/drf/tenant/", ScriptFactory(reject="invalid"), key=new_key(),
             headers=tenant)  # fmt: skip
    assert IdempotencyRecord.objects.count() == 150
