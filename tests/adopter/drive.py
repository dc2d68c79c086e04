"""Day one of the team's project, from outside: run by .ci/adopter in the project's own
virtualenv, against its runserver, with its worker and relay running. Every keyed request is
sent again, and each effect is counted in the database: exactly once.

python drive.py BASE_URL celery|tasks
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import django
import requests

BASE, FLAVOUR = sys.argv[1].rstrip("/"), sys.argv[2]
PROJECT = Path.cwd()
sys.path.insert(0, str(PROJECT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.db import connection  # noqa: E402
from payments.models import ApiClient, Event, LedgerEntry, Transfer  # noqa: E402
from rest_framework.authtoken.models import Token  # noqa: E402

from django_idempotency.models import IdempotencyRecord, OutboxMessage  # noqa: E402

FAILURES: list[str] = []
BEGAN = time.monotonic()


def section(title: str) -> None:
    print(f"--- {title} ({time.monotonic() - BEGAN:.0f}s)", flush=True)


def check(condition: bool, what: str, detail: object = "") -> None:
    print(("PASS " if condition else "FAIL ") + what, flush=True)
    if not condition:
        FAILURES.append(what)
        if detail:
            print(f"     {detail}", flush=True)


def events(kind: str) -> int:
    return Event.objects.filter(kind=kind).count()


def key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


def twice(send: Callable[[], requests.Response], status: int, what: str) -> requests.Response:
    """Sends a keyed request and its retry: the retry must be the first's replay."""
    first, retry = send(), send()
    check(
        first.status_code == status and "Idempotent-Replayed" not in first.headers,
        f"{what}: {status}",
        f"{first.status_code} {first.headers} {first.content[:300]!r}",
    )
    check(
        retry.status_code == status
        and retry.headers.get("Idempotent-Replayed") == "true"
        and retry.content == first.content,
        f"{what}: the retry is its replay",
        f"{retry.status_code} {retry.headers} {retry.content[:300]!r}",
    )
    return first


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


# The team's data: two users with DRF tokens, two API partners.
alice = User.objects.create_superuser("alice", "alice@example.com", "alice-password")
bob = User.objects.create_user("bob", password="bob-password")
ALICE = {"Authorization": f"Token {Token.objects.create(user=alice).key}"}
BOB = {"Authorization": f"Token {Token.objects.create(user=bob).key}"}
acme = ApiClient.objects.create(name="acme", key="acme-" + uuid.uuid4().hex)
globex = ApiClient.objects.create(name="globex", key="globex-" + uuid.uuid4().hex)
http = requests.Session()
INVOICES = f"{BASE}/api/invoices/"

section(f"the ModelViewSet under token authentication ({FLAVOUR})")
body = {"amount": 2499, "currency": "inr"}
k = key()
created = twice(lambda: http.post(INVOICES, json=body, headers={**ALICE, **k}), 201, "create")
invoice = created.json()["id"]
reused = http.post(INVOICES, json={**body, "amount": 1}, headers={**ALICE, **k})
check(reused.status_code == 422, "create: the same key with another body is 422", reused.text)
bobs = http.post(INVOICES, json=body, headers={**BOB, **k})
check(
    bobs.status_code == 201 and "Idempotent-Replayed" not in bobs.headers,
    "create: Bob's request with Alice's key runs as his own",
    bobs.text,
)
check(events("invoice.created") == 2, "create: one invoice per principal and key")
# Keys are optional (the default): a keyless create runs, and enqueues, as a keyed one does.
keyless = http.post(INVOICES, json=body, headers=ALICE)
check(keyless.status_code == 201, "create without a key: 201", keyless.status_code)
detail = f"{INVOICES}{invoice}/"
k = key()
twice(
    lambda: http.put(detail, json={"amount": 3000, "currency": "inr"}, headers={**ALICE, **k}),
    200,
    "update (PUT)",
)
check(events("invoice.updated") == 1, "update: executed once")
k = key()
twice(lambda: http.patch(detail, json={"amount": 3100}, headers={**ALICE, **k}), 200, "PATCH")
check(events("invoice.patched") == 1, "partial_update: executed once")
k = key()
twice(lambda: http.post(f"{detail}pay/", json={}, headers={**ALICE, **k}), 201, "@action pay")
check(events("invoice.paid") == 1, "@action pay: executed once")
other = http.post(INVOICES, json=body, headers={**ALICE, **key()}).json()["id"]
k = key()
twice(lambda: http.delete(f"{INVOICES}{other}/", headers={**ALICE, **k}), 204, "destroy")
check(events("invoice.deleted") == 1, "destroy: executed once")
stranger = http.post(f"{detail}pay/", json={}, headers={**BOB, **key()})
check(stranger.status_code == 404, "Bob cannot pay Alice's invoice", stranger.status_code)

section("the ModelViewSet under session authentication")
browser = requests.Session()
browser.get(f"{BASE}/admin/login/")
login = browser.post(
    f"{BASE}/admin/login/?next=/admin/",
    data={
        "username": "alice",
        "password": "alice-password",
        "csrfmiddlewaretoken": browser.cookies["csrftoken"],
        "next": "/admin/",
    },
    headers={"Referer": f"{BASE}/admin/login/"},
)
check(login.status_code == 200 and "sessionid" in browser.cookies, "log in to the admin")
csrf = {"X-CSRFToken": browser.cookies["csrftoken"], "Referer": BASE + "/"}
before = events("invoice.created")
k = key()
twice(lambda: browser.post(INVOICES, json=body, headers={**csrf, **k}), 201, "session: create")
check(events("invoice.created") == before + 1, "session: executed once")

section("the admin")
listing = browser.get(f"{BASE}/admin/django_idempotency/idempotencyrecord/")
check(listing.status_code == 200, "admin: the records' list answers 200", listing.status_code)
links = re.findall(
    r'href="(/admin/django_idempotency/idempotencyrecord/[^"/]+/change/[^"]*)"', listing.text
)
check(bool(links), "admin: the list links to records")
if links:
    page = browser.get(BASE + links[0].replace("&amp;", "&"))
    check(page.status_code == 200, "admin: a record's page answers 200", page.status_code)
outbox = browser.get(f"{BASE}/admin/django_idempotency/outboxmessage/")
check(outbox.status_code == 200, "admin: the outbox's list answers 200", outbox.status_code)

section("@idempotent behind the team's API-key decorator")
TRANSFERS = f"{BASE}/transfers/"
ACME, GLOBEX = {"X-Api-Key": acme.key}, {"X-Api-Key": globex.key}
k = key()
first = twice(
    lambda: http.post(TRANSFERS, json={"amount": 700}, headers={**ACME, **k}), 201, "transfer"
)
theirs = http.post(TRANSFERS, json={"amount": 700}, headers={**GLOBEX, **k})
check(
    theirs.status_code == 201
    and "Idempotent-Replayed" not in theirs.headers
    and theirs.json()["id"] != first.json()["id"],
    "transfer: another partner with the same key runs as its own",
    theirs.text,
)
for name, headers in {"no API key": {}, "a wrong API key": {"X-Api-Key": "nope"}}.items():
    refused = http.post(TRANSFERS, json={"amount": 700}, headers={**headers, **k})
    check(
        refused.status_code == 401 and "Idempotent-Replayed" not in refused.headers,
        f"transfer with {name}: 401, never a replay",
        f"{refused.status_code} {refused.text}",
    )
check(Transfer.objects.count() == 2, "transfer: one per partner and key")
missing = http.post(TRANSFERS, json={"amount": 700}, headers=ACME)
check(missing.status_code == 400, "transfer without Idempotency-Key: 400", missing.status_code)

section("concurrent duplicates")
k = key()
gate = threading.Barrier(8)
answers: list[requests.Response] = []


def duplicate() -> None:
    with requests.Session() as own:
        gate.wait()
        answers.append(own.post(TRANSFERS, json={"amount": 900}, headers={**ACME, **k}))


threads = [threading.Thread(target=duplicate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
statuses = sorted(r.status_code for r in answers)
check(
    set(statuses) <= {201, 409} and Transfer.objects.filter(amount=900).count() == 1,
    f"8 concurrent duplicates: one transfer ({statuses})",
)
retry = http.post(TRANSFERS, json={"amount": 900}, headers={**ACME, **k})
check(
    retry.headers.get("Idempotent-Replayed") == "true", "their retry is a replay", retry.status_code
)

section("encryption at rest")
stored = IdempotencyRecord.objects.exclude(response_body=None)
plain = [r.pk for r in stored if not r.body_encoding or b"2499" in bytes(r.response_body)]
check(stored.exists() and not plain, f"{stored.count()} stored responses, all sealed", plain)

section("the outbox, through " + FLAVOUR)
messages = OutboxMessage.objects.count()
expected = events("invoice.created") + events("invoice.paid")
check(messages == expected, f"one outbox message per created or paid invoice ({messages})")
published = wait_for(lambda: not OutboxMessage.objects.filter(published_at=None).exists(), 60)
check(published, "the relay published every message")
done = wait_for(lambda: LedgerEntry.objects.count() >= expected, 90)
check(done and LedgerEntry.objects.count() == expected, f"the worker wrote {expected} entries")


def consumed(message: Any) -> bool:
    """The message's consumer committed its record (what the redrive checks too)."""
    return IdempotencyRecord.objects.filter(key=str(message.pk), status=1).exists()


again = OutboxMessage.objects.order_by("created_at").first()
assert again is not None
check(wait_for(lambda: consumed(again), 30), "the consumer recorded the message")
# A relay that died between publishing and marking publishes it again, under its id.
OutboxMessage.objects.filter(pk=again.pk).update(published_at=None, redrive_at=None)
check(
    wait_for(lambda: OutboxMessage.objects.get(pk=again.pk).published_at is not None, 30),
    "a message published again",
)
if FLAVOUR == "tasks":
    from django_tasks_db.models import DBTaskResult

    finished = wait_for(
        lambda: DBTaskResult.objects.filter(status__in=["READY", "RUNNING"]).count() == 0, 30
    )
else:
    import redis
    from django.conf import settings

    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    finished = wait_for(lambda: broker.llen("celery") == 0 and broker.hlen("unacked") == 0, 30)
check(finished, "the worker took the second delivery")
check(LedgerEntry.objects.count() == expected, "its effect is not repeated")

if FLAVOUR == "celery":
    section("partition maintenance from Celery's beat_schedule")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'django_idempotency_record'::regclass ORDER BY 1 DESC LIMIT 1"
        )
        (newest,) = cursor.fetchone()
        cursor.execute(f'DROP TABLE "{newest}"')

    def exists() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [newest])
            return bool(cursor.fetchone()[0])

    check(wait_for(exists, 60), f"beat's maintenance made {newest} again")

section("the deployment probe")
# Both views at once: each authenticates with its own header and ignores the other.
probe = subprocess.run(
    [
        sys.executable,
        "manage.py",
        "idempotency_probe",
        f"{BASE}/idempotency/probe/",
        "--duplicates",
        "8",
        "--endpoint",
        "/api/invoices/",
        "--endpoint",
        "/transfers/",
        "--header",
        f"Authorization: {ALICE['Authorization']}",
        "--header",
        f"X-Api-Key: {acme.key}",
    ],
    capture_output=True,
    text=True,
    env={**os.environ, "IDEMPOTENCY_PROBE_TOKEN": os.environ["SHOP_PROBE_TOKEN"]},
    check=False,
)
print(probe.stdout + probe.stderr, flush=True)
check(
    probe.returncode == 0
    and "endpoint /api/invoices/: checks passed" in probe.stdout
    and "endpoint /transfers/: checks passed" in probe.stdout,
    "the probe passes, for both views",
)

section(f"{len(FAILURES)} failed" if FAILURES else "day one: every effect exactly once")
sys.exit(1 if FAILURES else 0)
