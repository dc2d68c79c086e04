"""SQLite (development): the same model is a plain table with a unique (scope, key) index,
and the engine works on it.

The suite runs on PostgreSQL, so ``test_sqlite_fallback_suite_passes`` runs this module
again in a child pytest on a SQLite settings module; there, and only there, the
``test_on_sqlite_*`` tests run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.test import Client
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import bodies
from django_idempotency.storage import records as storage
from django_idempotency.storage.erasure import erase, tombstone_scope
from django_idempotency.storage.records import Outcome
from django_idempotency.storage.usage import usage
from tests.factories import IdempotencyRecordFactory, ScriptFactory, new_key
from tests.support.claims import claim, store_first
from tests.support.client import problem, send
from tests.support.views import CALLS, GATES, Boom, business_rows

ROOT = Path(__file__).resolve().parents[2]
INNER = os.environ.get("IDEMPOTENCY_SQLITE_SUITE") == "1"

SQLITE_SETTINGS = """
SECRET_KEY = "sqlite-fallback-tests-only"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "rest_framework",
    "rest_framework.authtoken",
    "django_idempotency",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.support.urls"
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {name!r}}}}}
USE_TZ = True
ALLOWED_HOSTS = ["testserver"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
"""


@pytest.mark.skipif(INNER, reason="this is the SQLite run itself")
def test_sqlite_fallback_suite_passes(tmp_path: Path) -> None:
    (tmp_path / "sqlite_fallback_settings.py").write_text(
        SQLITE_SETTINGS.format(name=str(tmp_path / "fallback.sqlite3"))
    )
    env = {
        **os.environ,
        "IDEMPOTENCY_SQLITE_SUITE": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    env.pop("DATABASE_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "--ds=sqlite_fallback_settings",
         # The shared conftest is about PostgreSQL servers; this run needs none of it.
         "--noconftest", "-p", "no:randomly", "-q", "-rfEs"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    inner_tests = [name for name in globals() if name.startswith("test_on_sqlite_")]
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) >= len(inner_tests), output
    assert "failed" not in output and "error" not in output.lower(), output


on_sqlite = pytest.mark.skipif(not INNER, reason="runs in the SQLite child pytest")
pytestmark = pytest.mark.urls("tests.support.urls")
ENDPOINTS = pytest.mark.parametrize("path", ["/drf/", "/plain/"])


@on_sqlite
@pytest.mark.django_db
def test_on_sqlite_the_records_table_is_plain_with_a_unique_key_scope_index() -> None:
    assert connection.vendor == "sqlite"
    with connection.cursor() as cursor:
        cursor.execute("SELECT type FROM sqlite_master WHERE name = 'django_idempotency_record'")
        assert cursor.fetchone() == ("table",)
        cursor.execute("PRAGMA index_list('django_idempotency_record')")
        unique = [row[1] for row in cursor.fetchall() if row[2]]
        columns = []
        for index in unique:
            cursor.execute(f"PRAGMA index_info('{index}')")
            columns.append([row[2] for row in cursor.fetchall()])
    assert ["key", "scope"] in columns


@on_sqlite
@pytest.mark.django_db
def test_on_sqlite_the_migration_makes_the_shared_secret_that_keys_the_locks() -> None:
    from django_idempotency.engine.hashing import current_secret

    with connection.cursor() as cursor:
        cursor.execute("SELECT id, secret FROM django_idempotency_secret")
        [(row_id, made)] = cursor.fetchall()
    assert row_id == 1 and len(made) == 64
    assert current_secret("default") == made


@on_sqlite
@pytest.mark.django_db
def test_on_sqlite_a_second_row_for_the_same_scope_and_key_is_refused() -> None:
    record = IdempotencyRecordFactory()
    with pytest.raises(IntegrityError), transaction.atomic():
        IdempotencyRecordFactory(scope=record.scope, key=record.key)
    # Another principal may use the same key.
    IdempotencyRecordFactory(scope="user:2", key=record.key)


@on_sqlite
@pytest.mark.django_db
@ENDPOINTS
def test_on_sqlite_the_first_request_executes_and_retries_replay(client, path: str) -> None:
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1


@on_sqlite
@pytest.mark.django_db
def test_on_sqlite_a_large_body_is_compressed_by_the_app_and_looked_up(client) -> None:
    # No TOAST here: the app compresses; the lock-free lookup reads through Django's cursor.
    key, script = new_key(), ScriptFactory(pad=64_000)
    first = send(client, "POST", "/drf/lookup-first/", script, key=key)
    retry = send(client, "POST", "/drf/lookup-first/", script, key=key)
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert IdempotencyRecord.objects.get(key=key).body_encoding == bodies.compression(None)


@on_sqlite
@pytest.mark.django_db
@ENDPOINTS
def test_on_sqlite_a_changed_request_is_422(client, path: str) -> None:
    key, script = new_key(), ScriptFactory()
    send(client, "POST", path, script, key=key)
    response = send(client, "POST", path, {**script, "amount": 1}, key=key)
    assert response.status_code == 422
    assert problem(response)["differing"] == ["body"]


@on_sqlite
@pytest.mark.django_db(transaction=True)
@ENDPOINTS
def test_on_sqlite_a_failed_first_execution_leaves_nothing(client, path: str) -> None:
    raising, failing = ScriptFactory(fail="raise", once=True), ScriptFactory(status=503)
    key = new_key()
    with pytest.raises(Boom):
        send(client, "POST", path, raising, key=key)
    assert (business_rows(raising["tag"]), IdempotencyRecord.objects.count()) == (0, 0)
    assert send(client, "POST", path, raising, key=key).status_code == 201
    send(client, "POST", path, failing, key=new_key())
    assert business_rows(failing["tag"]) == 0
    assert IdempotencyRecord.objects.count() == 1


@on_sqlite
@pytest.mark.django_db(transaction=True)
def test_on_sqlite_an_unstored_status_frees_the_key(client) -> None:
    key, script = new_key(), ScriptFactory(status=429)
    send(client, "POST", "/drf/", script, key=key)
    assert not IdempotencyRecord.objects.exists()
    assert "Idempotent-Replayed" not in send(client, "POST", "/drf/", script, key=key)
    assert CALLS[script["tag"]] == 2


@on_sqlite
@pytest.mark.django_db
def test_on_sqlite_an_expired_record_is_gone_then_replaced() -> None:
    key, now = new_key(), timezone.now()
    with transaction.atomic():
        store_first("anonymous", key, claim("anonymous", key, now=now), ttl=timedelta(hours=1))
    gone = timedelta(hours=1)
    with transaction.atomic():
        assert claim("anonymous", key, now=now + timedelta(minutes=30)).outcome == Outcome.FOUND
    with transaction.atomic():
        late = claim("anonymous", key, now=now + timedelta(minutes=90), gone=gone)
        assert late.outcome == Outcome.EXPIRED
    with transaction.atomic():
        renewed = claim("anonymous", key, now=now + timedelta(minutes=150), gone=gone)
        assert renewed.outcome == Outcome.WON
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@on_sqlite
@pytest.mark.django_db
def test_on_sqlite_an_erased_key_is_expired_until_the_record_would_have_expired() -> None:
    key, now = new_key(), timezone.now()
    with transaction.atomic():
        store_first("tenant:a", key, claim("tenant:a", key, now=now), ttl=timedelta(hours=1))
    assert erase("default", "tenant:a", batch=1) == 1
    assert erase("default", "tenant:a", batch=1) == 0
    with transaction.atomic():
        assert claim("tenant:a", key, now=now).outcome == Outcome.EXPIRED
    tomb = IdempotencyRecord.objects.get(scope=tombstone_scope("default", "tenant:a"))
    assert tomb.response_body is None and tomb.status == IdempotencyRecord.Status.ERASED
    with transaction.atomic():
        assert claim("tenant:a", key, now=now + timedelta(minutes=61)).outcome == Outcome.WON


@on_sqlite
@pytest.mark.django_db
def test_on_sqlite_a_record_of_another_version_is_stale_then_replaced() -> None:
    key, now = new_key(), timezone.now()
    record = IdempotencyRecordFactory(scope="tenant:a", key=key, response_version="1")
    with transaction.atomic():
        stale = storage.claim(
            "default", lock=0, principal="tenant:a", key=key, window=timedelta(days=1),
            gone=timedelta(0), wait=timedelta(0), now=now, version="2",
        )  # fmt: skip
        assert stale.outcome == Outcome.STALE and stale.record is not None
        renewed = storage.reclaim("default", stale, principal="tenant:a", key=key)
    assert renewed.outcome == Outcome.WON and renewed.row_id is not None
    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert usage("default", now.date(), top=5)[0].principal == "tenant:a"


@on_sqlite
@pytest.mark.django_db(transaction=True)
def test_on_sqlite_a_concurrent_duplicate_never_executes_twice() -> None:
    key, script = new_key(), ScriptFactory(gate=new_key())
    results: dict[str, Any] = {}

    def first() -> None:
        try:
            results["first"] = send(Client(), "POST", "/plain/", script, key=key)
        finally:
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    assert GATES.wait_entered(script["gate"], 60)
    try:
        duplicate = send(Client(), "POST", "/plain/", script, key=key)
    finally:
        GATES.open(script["gate"])
        thread.join(60)
    # SQLite has one writer: the duplicate loses on the unique index (409) or on the
    # database lock (503, fail closed); either way it did not run.
    assert duplicate.status_code in (409, 503)
    assert results["first"].status_code == 201
    assert CALLS[script["tag"]] == 1
    retry = send(Client(), "POST", "/plain/", script, key=key)
    assert retry["Idempotent-Replayed"] == "true"
