"""The records admin: read-only pages, exact search, cheap filters, escaped bodies, and a
permissioned delete that frees the key; the outbox and CDC events admins: read-only,
append-only."""

from __future__ import annotations

import importlib.util
import json
import uuid
import zlib
from datetime import timedelta

import pytest
import zstandard
from django.contrib.auth.models import Permission, User
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from django_idempotency.admin import EstimatedCountPaginator
from django_idempotency.http.endpoints import idempotent_endpoints
from django_idempotency.messaging.cdc import emit_event
from django_idempotency.messaging.outbox import enqueue_event, enqueue_task
from django_idempotency.models import IdempotencyRecord, OutboxEvent, OutboxMessage, RelayHeartbeat
from django_idempotency.partitions import catalog
from django_idempotency.partitions.catalog import day_bounds, utc_today
from django_idempotency.partitions.tables import RECORDS
from tests.factories import IdempotencyRecordFactory, new_key

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:django_idempotency_idempotencyrecord_changelist")


def detail_url(record: IdempotencyRecord) -> str:
    return reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk])


def delete_url(record: IdempotencyRecord) -> str:
    return reverse("admin:django_idempotency_idempotencyrecord_delete", args=[record.pk])


@pytest.fixture
def superuser_client(client):
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", "x"))
    return client


@pytest.fixture
def viewer_client(client):
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    client.force_login(viewer)
    return client


def listed(response) -> list[int]:
    return [record.pk for record in response.context["cl"].result_list]


def offered(response, parameter: str) -> list[str]:
    [spec] = [s for s in response.context["cl"].filter_specs if s.parameter_name == parameter]
    return [value for value, _ in spec.lookup_choices]


def test_changelist_lists_records_newest_first(superuser_client):
    older = IdempotencyRecordFactory(created_at=timezone.now() - timedelta(hours=2))
    newer = IdempotencyRecordFactory()

    response = superuser_client.get(CHANGELIST)

    assert response.status_code == 200
    assert listed(response) == [newer.pk, older.pk]
    assert newer.key in response.text


def test_changelist_takes_a_handful_of_queries_with_filter_choices_computed_without_scanning(
    superuser_client, django_assert_max_num_queries
):
    IdempotencyRecordFactory.create_batch(60)

    with CaptureQueriesContext(connection) as queries, django_assert_max_num_queries(6):
        response = superuser_client.get(CHANGELIST)

    assert response.status_code == 200
    assert len(listed(response)) == 50
    statements = [q["sql"].upper() for q in queries]
    assert not [sql for sql in statements if "DISTINCT" in sql]
    # No exact COUNT(*) of the table: the planner's estimate stands in for it.
    assert not [sql for sql in statements if "COUNT(*)" in sql and "LIMIT" not in sql]
    # The page never loads the bodies it does not show.
    page = next(sql for sql in statements if "ORDER BY" in sql)
    assert "RESPONSE_BODY" not in page
    assert page.rstrip().endswith("LIMIT 50")


def test_search_matches_the_exact_case_sensitive_key(superuser_client):
    record = IdempotencyRecordFactory(key="Order-7f3a")
    IdempotencyRecordFactory(key="order-7f3a")
    IdempotencyRecordFactory(key="Order-7f3a-2")

    with CaptureQueriesContext(connection) as queries:
        response = superuser_client.get(CHANGELIST, {"q": " Order-7f3a "})

    assert listed(response) == [record.pk]
    assert not [q for q in queries if "UPPER(" in q["sql"].upper()]
    assert superuser_client.get(CHANGELIST, {"q": '"Order-7f3a"'}).context["cl"].result_count == 1
    assert listed(superuser_client.get(CHANGELIST, {"q": "Order"})) == []


def test_search_for_something_that_is_no_key_finds_nothing(superuser_client):
    IdempotencyRecordFactory(key="abc")

    response = superuser_client.get(CHANGELIST, {"q": "a b c"})

    assert response.status_code == 200
    assert listed(response) == []


def test_created_filter_offers_the_partition_days_and_prunes_to_one(superuser_client, monkeypatch):
    # The filter's day is the test's: a midnight UTC passed during the test moves neither.
    today = utc_today()
    monkeypatch.setattr(catalog, "utc_today", lambda: today)
    yesterday = today - timedelta(days=1)
    start, _ = day_bounds(yesterday)
    old = IdempotencyRecordFactory(created_at=start + timedelta(hours=3))
    recent = IdempotencyRecordFactory(created_at=timezone.now() - timedelta(minutes=5))

    days = offered(superuser_client.get(CHANGELIST), "created")
    assert days[:4] == ["1h", "24h", today.isoformat(), yesterday.isoformat()]
    # Partitions exist for the days ahead too, but no record is created there yet.
    assert (today + timedelta(days=1)).isoformat() not in days

    assert listed(superuser_client.get(CHANGELIST, {"created": yesterday.isoformat()})) == [old.pk]
    assert listed(superuser_client.get(CHANGELIST, {"created": "1h"})) == [recent.pk]
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN SELECT id FROM django_idempotency_record "
            "WHERE created_at >= %s AND created_at < %s",
            day_bounds(yesterday),
        )
        plan = " ".join(row[0] for row in cursor.fetchall())
    assert RECORDS.partition_name(yesterday) in plan
    assert RECORDS.partition_name(today) not in plan


def test_created_filter_rejects_a_malformed_day(superuser_client):
    response = superuser_client.get(CHANGELIST, {"created": "yesterday"})

    assert response.status_code == 302
    assert response["Location"].endswith("?e=1")


def test_response_status_filter_selects_a_status_class(superuser_client):
    created = IdempotencyRecordFactory(response_code=201)
    redirected = IdempotencyRecordFactory(response_code=303)
    rejected = IdempotencyRecordFactory(response_code=422)

    def found(value: str) -> list[int]:
        return listed(superuser_client.get(CHANGELIST, {"response": value}))

    assert found("2xx") == [created.pk]
    assert found("3xx") == [redirected.pk]
    assert found("4xx") == [rejected.pk]


def test_method_filter_offers_the_covered_methods_and_consumers_tasks(superuser_client):
    post = IdempotencyRecordFactory(method="POST")
    patch = IdempotencyRecordFactory(method="PATCH")
    task = IdempotencyRecordFactory(method="TASK")

    response = superuser_client.get(CHANGELIST, {"method": "PATCH"})

    assert offered(response, "method") == ["PATCH", "POST", "TASK"]
    assert listed(superuser_client.get(CHANGELIST, {"method": "TASK"})) == [task.pk]
    assert listed(response) == [patch.pk]
    assert listed(superuser_client.get(CHANGELIST, {"method": "POST"})) == [post.pk]


def test_endpoint_filter_offers_the_idempotent_routes_and_matches_their_paths(superuser_client):
    charge = IdempotencyRecordFactory(path="/api/charges/")
    refund = IdempotencyRecordFactory(path="/api/refunds/")
    IdempotencyRecordFactory(path="/api/charges/extra/")

    response = superuser_client.get(CHANGELIST, {"endpoint": "/api/charges/"})

    routes = offered(response, "endpoint")
    assert "/api/charges/" in routes and "/api/refunds/" in routes
    # Views without idempotency are no endpoint of ours.
    assert "/api/charges-plain/" not in routes and "/api/charges/count/" not in routes
    assert listed(response) == [charge.pk]
    assert listed(superuser_client.get(CHANGELIST, {"endpoint": "/api/refunds/"})) == [refund.pk]
    assert superuser_client.get(CHANGELIST, {"endpoint": "/nowhere/"}).status_code == 302


@pytest.mark.urls("tests.support.urls")
def test_endpoints_follow_the_views_overrides_and_route_parameters():
    endpoints = {endpoint.route: endpoint for endpoint in idempotent_endpoints()}

    assert endpoints["/drf/"].methods == {"POST", "PATCH"}
    assert endpoints["/drf/put-only/"].methods == {"PUT"}
    # A viewset serves POST on its list route and PATCH on its detail route.
    assert endpoints["/drf/groups/"].methods == {"POST"}
    detail = endpoints["/drf/groups/<pk>/"]
    assert detail.methods == {"PATCH"}
    records = IdempotencyRecord.objects.filter(path__regex=detail.regex)
    matching = IdempotencyRecordFactory(path="/drf/groups/42/")
    IdempotencyRecordFactory(path="/drf/groups/42/rename/")
    assert list(records) == [matching]


def test_detail_shows_the_request_fingerprint_and_the_pretty_printed_response(superuser_client):
    record = IdempotencyRecordFactory(
        scope="user:7",
        method="PATCH",
        path="/api/charges/",
        fingerprint={"method": "a" * 64, "path": "b" * 64, "header:x-account": "c" * 64},
        response_headers=[["Content-Type", "application/json"], ["Location", "/api/charges/9/"]],
        response_body=b'{"id":9,"amount":2499}',
    )

    response = superuser_client.get(detail_url(record))

    assert response.status_code == 200
    page = response.text
    for text in (
        record.key,
        "user:7",
        "PATCH",
        "/api/charges/",
        "header:x-account",
        "a" * 64,
        "Location: /api/charges/9/",
    ):
        assert text in page
    assert escape(json.dumps({"id": 9, "amount": 2499}, indent=2)) in page
    # Read-only: no form to save.
    assert 'name="_save"' not in page


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [("zlib", zlib.compress), ("zstd", zstandard.ZstdCompressor().compress)],
)
def test_detail_decompresses_a_compressed_body(superuser_client, encoding, compress):
    body = json.dumps({"items": list(range(500))}).encode()
    record = IdempotencyRecordFactory(response_body=compress(body), body_encoding=encoding)

    response = superuser_client.get(detail_url(record))

    assert escape('"items": [\n    0,\n    1,') in response.text


def test_detail_escapes_stored_markup(superuser_client):
    script = "<script>alert(1)</script>"
    record = IdempotencyRecordFactory(
        response_headers=[["Content-Type", "text/html"], ["Link", script]],
        response_body=script.encode(),
        fingerprint={"body": script},
    )
    json_record = IdempotencyRecordFactory(response_body=json.dumps({"note": script}).encode())

    for shown in (record, json_record):
        page = superuser_client.get(detail_url(shown)).text
        assert script not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_detail_describes_a_binary_body_instead_of_dumping_it(superuser_client):
    record = IdempotencyRecordFactory(response_body=b"\x89PNG\r\n\x1a\n\xff\xfe")

    response = superuser_client.get(detail_url(record))

    assert "10 bytes of binary data" in response.text


def test_view_only_staff_can_list_and_open_records_but_not_add_change_or_delete(viewer_client):
    record = IdempotencyRecordFactory()

    assert viewer_client.get(CHANGELIST).status_code == 200
    page = viewer_client.get(detail_url(record))
    assert page.status_code == 200
    assert delete_url(record) not in page.text
    assert (
        viewer_client.get(reverse("admin:django_idempotency_idempotencyrecord_add")).status_code
        == 403
    )
    assert viewer_client.post(detail_url(record), {"key": "changed"}).status_code == 403
    assert viewer_client.get(delete_url(record)).status_code == 403
    assert viewer_client.post(delete_url(record), {"post": "yes"}).status_code == 403
    assert IdempotencyRecord.objects.filter(pk=record.pk, key=record.key).exists()


def test_superuser_cannot_add_or_change_either(superuser_client):
    record = IdempotencyRecordFactory(method="POST")

    assert (
        superuser_client.get(reverse("admin:django_idempotency_idempotencyrecord_add")).status_code
        == 403
    )
    assert superuser_client.post(detail_url(record), {"method": "PATCH"}).status_code == 403
    record.refresh_from_db()
    assert record.method == "POST"


def test_the_only_bulk_action_is_erasure(superuser_client):
    IdempotencyRecordFactory()

    response = superuser_client.get(CHANGELIST)

    assert "delete_selected" not in response.text
    assert [name for name, _ in response.context["action_form"].fields["action"].choices][1:] == [
        "erase_principals"
    ]


def test_a_viewer_is_offered_no_bulk_action(viewer_client):
    IdempotencyRecordFactory()

    # Erasing takes the delete permission.
    assert viewer_client.get(CHANGELIST).context["action_form"] is None


def test_deleting_asks_for_confirmation_then_frees_the_key(superuser_client, api_client):
    key = new_key()
    charge = {"amount": 2499, "currency": "inr"}
    first = api_client.post("/api/charges/", charge, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == 201
    record = IdempotencyRecord.objects.get(key=key)

    confirmation = superuser_client.get(delete_url(record))
    assert confirmation.status_code == 200
    assert "Are you sure" in confirmation.text
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()

    with CaptureQueriesContext(connection) as queries:
        deleted = superuser_client.post(delete_url(record), {"post": "yes"})
    assert deleted.status_code == 302
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    [delete] = [
        q["sql"]
        for q in queries
        if q["sql"].startswith("DELETE") and "django_idempotency_record" in q["sql"]
    ]
    assert '"created_at" =' in delete  # pruned to the record's partition

    retry = api_client.post("/api/charges/", charge, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert retry.json()["id"] != first.json()["id"]


def test_paginator_counts_small_results_exactly_and_large_ones_by_estimate(monkeypatch):
    monkeypatch.setattr(EstimatedCountPaginator, "exact_below", 20)
    IdempotencyRecordFactory.create_batch(30, method="POST")
    IdempotencyRecordFactory.create_batch(5, method="PATCH")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_idempotency_record")
    records = IdempotencyRecord.objects.order_by("-id")

    small = EstimatedCountPaginator(records.filter(method="PATCH"), 10)
    assert (small.count, small.estimated) == (5, False)

    large = EstimatedCountPaginator(records, 10)
    assert large.count >= 20
    assert large.estimated is True


def test_changelist_says_an_estimated_count_is_one(superuser_client, monkeypatch):
    monkeypatch.setattr(EstimatedCountPaginator, "exact_below", 20)
    IdempotencyRecordFactory.create_batch(30)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_idempotency_record")

    response = superuser_client.get(CHANGELIST)

    assert response.context["cl"].paginator.estimated
    assert "About" in response.text


@pytest.mark.urls("tests.support.urls")
def test_idempotent_plain_views_are_found_for_the_endpoint_filter() -> None:
    found = {endpoint.route: endpoint.methods for endpoint in idempotent_endpoints()}
    assert found["/plain/"] == frozenset({"POST", "PATCH"})
    assert found["/plain/put-only/"] == frozenset({"PUT"})


def page_principals(principals: list[str]) -> dict[str, str]:
    """An IDEMPOTENCY_PRINCIPAL_DISPLAY of a project whose principals are tenants."""
    page_principals.calls.append(principals)  # type: ignore[attr-defined]
    return {p: p.removeprefix("tenant:").title() for p in principals if p.startswith("tenant:")}


def test_changelist_shows_usernames_resolved_in_one_query_per_page(
    superuser_client, django_assert_num_queries
):
    users = [User.objects.create_user(f"customer{n}") for n in range(10)]
    for n in range(60):
        IdempotencyRecordFactory(scope=f"user:{users[n % 10].pk}")
    IdempotencyRecordFactory(scope="user:999999")
    IdempotencyRecordFactory(scope="anonymous")
    with (
        override_settings(IDEMPOTENCY_PRINCIPAL_DISPLAY=lambda principals: {}),
        CaptureQueriesContext(connection) as without_names,
    ):
        superuser_client.get(CHANGELIST)

    with django_assert_num_queries(len(without_names) + 1) as queries:
        response = superuser_client.get(CHANGELIST)

    assert response.status_code == 200
    for user in users:
        assert f"{user.username} (user:{user.pk})" in response.text
    # A principal with no user left, and one that is no user, show as stored.
    assert '<td class="field-principal">user:999999</td>' in response.text
    assert '<td class="field-principal">anonymous</td>' in response.text
    # The one extra query: all the page's user ids at once.
    assert len([q for q in queries if '"auth_user"."id" IN' in q["sql"]]) == 1


def test_principal_display_hook_is_called_once_per_page_and_on_the_detail_page(
    superuser_client,
):
    page_principals.calls = []  # type: ignore[attr-defined]
    record = IdempotencyRecordFactory(scope="tenant:acme")
    IdempotencyRecordFactory(scope="tenant:globex")
    IdempotencyRecordFactory(scope="tenant:acme")

    with override_settings(IDEMPOTENCY_PRINCIPAL_DISPLAY=f"{__name__}.page_principals"):
        listing = superuser_client.get(CHANGELIST)
        detail = superuser_client.get(detail_url(record))

    assert page_principals.calls == [["tenant:acme", "tenant:globex"], ["tenant:acme"]]  # type: ignore[attr-defined]
    assert "Acme (tenant:acme)" in listing.text and "Globex (tenant:globex)" in listing.text
    assert "Acme (tenant:acme)" in detail.text


def test_detail_shows_the_username(superuser_client):
    alice = User.objects.create_user("alice")
    record = IdempotencyRecordFactory(scope=f"user:{alice.pk}")

    response = superuser_client.get(detail_url(record))

    assert f"alice (user:{alice.pk})" in response.text


def test_search_by_username_finds_that_users_records(superuser_client):
    alice = User.objects.create_user("alice")
    bob = User.objects.create_user("bob")
    alices = [IdempotencyRecordFactory(scope=f"user:{alice.pk}") for _ in range(2)]
    IdempotencyRecordFactory(scope=f"user:{bob.pk}")
    keyed_alice = IdempotencyRecordFactory(key="alice", scope=f"user:{bob.pk}")

    found = listed(superuser_client.get(CHANGELIST, {"q": "alice"}))
    nobody = listed(superuser_client.get(CHANGELIST, {"q": "mallory"}))

    # The key "alice" still matches as a key; the username adds alice's own records.
    assert sorted(found) == sorted([keyed_alice.pk, *(r.pk for r in alices)])
    assert nobody == []


def test_a_principal_callable_returning_the_user_is_shown_and_searched_by_username(
    superuser_client,
):
    # A principal callable that returns request.user stores the model's label and pk.
    alice = User.objects.create_user("alice")
    from_callable = IdempotencyRecordFactory(scope=f"auth.user:{alice.pk}")
    by_default = IdempotencyRecordFactory(scope=f"user:{alice.pk}")

    listing = superuser_client.get(CHANGELIST)
    found = listed(superuser_client.get(CHANGELIST, {"q": "alice"}))

    assert f"alice (auth.user:{alice.pk})" in listing.text
    assert f"alice (user:{alice.pk})" in listing.text
    assert sorted(found) == sorted([from_callable.pk, by_default.pk])


@pytest.mark.urls("tests.support.urls")
def test_endpoints_are_found_in_every_view_style() -> None:
    found: dict[str, set[str]] = {}
    for endpoint in idempotent_endpoints():
        found.setdefault(endpoint.route, set()).update(endpoint.methods)
    assert found["/drf/api-view/"] == {"POST"}  # @idempotent under @api_view
    assert found["/iban/above-api-view/"] == {"POST", "PATCH"}  # ... and above it
    assert found["/cbv/method-decorated/"] == {"POST"}  # method_decorator on a View
    assert found["/drf/method-decorated/"] == {"PUT"}  # ... and on an APIView
    assert found["/cbv/dispatch-decorated/"] == {"POST", "PATCH"}  # ... on dispatch()
    if importlib.util.find_spec("ninja"):
        assert found["/ninja/open/"] == {"POST"}
        assert found["/ninja/session/"] == {"POST"}


def test_the_endpoint_filter_offers_ninja_operations(superuser_client) -> None:
    pytest.importorskip("ninja")
    charge = IdempotencyRecordFactory(path="/ninja/charges/")
    IdempotencyRecordFactory(path="/ninja/charges/async/")
    response = superuser_client.get(CHANGELIST, {"endpoint": "/ninja/charges/"})
    assert {"/ninja/charges/", "/ninja/charges/async/"} <= set(offered(response, "endpoint"))
    assert listed(response) == [charge.pk]


# The outbox admin.

OUTBOX_CHANGELIST = reverse("admin:django_idempotency_outboxmessage_changelist")


def enqueued_task() -> uuid.UUID:
    with transaction.atomic():
        return uuid.UUID(enqueue_task("tests.noop", [1], {"note": "x" * 100}))


def test_outbox_admin_lists_newest_first_without_its_large_columns(superuser_client):
    older = enqueued_task()
    with transaction.atomic():
        newer = uuid.UUID(enqueue_event("charge.captured", {"id": 7}))

    with CaptureQueriesContext(connection) as queries:
        response = superuser_client.get(OUTBOX_CHANGELIST)

    assert response.status_code == 200
    assert listed(response) == [newer, older]
    # The one bulk action requeues dead letters; nothing deletes.
    actions = [value for value, _ in response.context["action_form"].fields["action"].choices]
    assert [a for a in actions if a] == ["requeue"]
    page = next(q["sql"].upper() for q in queries if "ORDER BY" in q["sql"].upper())
    assert not [column for column in ('"PAYLOAD"', '"KWARGS"', '"LAST_ERROR"') if column in page]


def test_outbox_admin_filters_by_state_and_finds_an_exact_message_id(superuser_client):
    pending, published = enqueued_task(), enqueued_task()
    OutboxMessage.objects.filter(pk=published).update(published_at=timezone.now())

    assert listed(superuser_client.get(OUTBOX_CHANGELIST, {"state": "pending"})) == [pending]
    assert listed(superuser_client.get(OUTBOX_CHANGELIST, {"state": "published"})) == [published]
    assert superuser_client.get(OUTBOX_CHANGELIST, {"state": "lost"}).status_code == 302
    assert listed(superuser_client.get(OUTBOX_CHANGELIST, {"q": f" {pending} "})) == [pending]
    assert listed(superuser_client.get(OUTBOX_CHANGELIST, {"q": "no-such-id"})) == []


def test_outbox_admin_adds_changes_and_deletes_nothing(superuser_client):
    message = enqueued_task()
    detail = reverse("admin:django_idempotency_outboxmessage_change", args=[message])
    delete = reverse("admin:django_idempotency_outboxmessage_delete", args=[message])

    assert superuser_client.get(detail).status_code == 200
    assert (
        superuser_client.get(reverse("admin:django_idempotency_outboxmessage_add")).status_code
        == 403
    )
    assert superuser_client.post(detail, {"name": "changed"}).status_code == 403
    assert superuser_client.post(delete, {"post": "yes"}).status_code == 403
    assert OutboxMessage.objects.filter(pk=message, name="tests.noop").exists()


# The CDC events' admin.

EVENTS_CHANGELIST = reverse("admin:django_idempotency_outboxevent_changelist")


def test_events_admin_lists_newest_first_without_payloads_and_finds_an_exact_id(
    superuser_client,
):
    with transaction.atomic():
        older = uuid.UUID(emit_event("order", 1, "OrderPlaced", {"note": "x" * 100}))
        newer = uuid.UUID(emit_event("order", 1, "OrderPaid", {"note": "y"}))

    with CaptureQueriesContext(connection) as queries:
        response = superuser_client.get(EVENTS_CHANGELIST)

    assert response.status_code == 200
    assert listed(response) == [newer, older]
    page = next(q["sql"].upper() for q in queries if "ORDER BY" in q["sql"].upper())
    assert '"PAYLOAD"' not in page
    assert listed(superuser_client.get(EVENTS_CHANGELIST, {"q": f" {older} "})) == [older]
    assert listed(superuser_client.get(EVENTS_CHANGELIST, {"q": "no-such-id"})) == []
    assert listed(superuser_client.get(EVENTS_CHANGELIST, {"created": "1h"})) == [newer, older]


def test_events_admin_adds_changes_and_deletes_nothing(superuser_client):
    with transaction.atomic():
        event = emit_event("order", 1, "OrderPlaced", {"total": 5})
    detail = reverse("admin:django_idempotency_outboxevent_change", args=[event])
    delete = reverse("admin:django_idempotency_outboxevent_delete", args=[event])

    shown = superuser_client.get(detail)
    assert shown.status_code == 200 and "OrderPlaced" in shown.content.decode()
    add = reverse("admin:django_idempotency_outboxevent_add")
    assert superuser_client.get(add).status_code == 403
    assert superuser_client.post(detail, {"event_type": "changed"}).status_code == 403
    assert superuser_client.post(delete, {"post": "yes"}).status_code == 403
    assert OutboxEvent.objects.filter(pk=event, event_type="OrderPlaced").exists()


# The relays' heartbeats.


def test_relay_heartbeats_are_listed_freshest_first_with_their_age_and_change_nothing(
    superuser_client,
):
    now = timezone.now()
    RelayHeartbeat.objects.create(
        owner="web-2:8:bb", host="web-2", pid=8, started_at=now - timedelta(hours=1),
        beat_at=now - timedelta(minutes=5),
    )  # fmt: skip
    RelayHeartbeat.objects.create(
        owner="web-1:7:aa", host="web-1", pid=7, started_at=now, beat_at=now, published=5
    )
    changelist = reverse("admin:django_idempotency_relayheartbeat_changelist")
    response = superuser_client.get(changelist)
    assert response.status_code == 200
    assert listed(response) == ["web-1:7:aa", "web-2:8:bb"]
    page = response.content.decode()
    # Only the one that has not beaten for five minutes is stale.
    assert page.count(" s ago: stale, the relay died or hangs") == 1
    assert response.context["action_form"] is None
    detail = reverse("admin:django_idempotency_relayheartbeat_change", args=["web-1:7:aa"])
    assert superuser_client.get(detail).status_code == 200
    assert superuser_client.post(detail, {"pid": 9}).status_code == 403
    delete = reverse("admin:django_idempotency_relayheartbeat_delete", args=["web-1:7:aa"])
    assert superuser_client.post(delete, {"post": "yes"}).status_code == 403
    assert RelayHeartbeat.objects.get(owner="web-1:7:aa").pid == 7
