from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import RequestFactory
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.engine.identity import canonical_body, differing, fingerprint
from django_idempotency.models import IdempotencyRecord
from tests.client import problem, send
from tests.factories import ScriptFactory, new_key
from tests.views import CALLS

pytestmark = pytest.mark.urls("tests.urls")

factory = RequestFactory()


def json_request(raw: str | bytes, path: str = "/x/", **extra: Any) -> Any:
    return factory.post(path, raw, content_type="application/json", **extra)


def reordered(value: Any) -> Any:
    """The same JSON value with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reordered(v) for v in value]
    return value


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.booleans())
def test_json_body_fingerprint_ignores_key_order_and_whitespace(
    body: dict[str, Any], indent: bool
) -> None:
    first = json_request(json.dumps(body))
    second = json_request(json.dumps(reordered(body), indent=2 if indent else None))
    assert fingerprint(first)["body"] == fingerprint(second)["body"]


def test_json_body_fingerprint_changes_with_a_value() -> None:
    first = json_request('{"amount": 2499, "currency": "inr"}')
    second = json_request('{"amount": 2500, "currency": "inr"}')
    assert fingerprint(first)["body"] != fingerprint(second)["body"]


def test_structured_json_content_types_are_canonicalised_too() -> None:
    first = factory.post("/x/", '{"a": 1, "b": 2}', content_type="application/vnd.api+json")
    second = factory.post("/x/", '{"b": 2, "a": 1}', content_type="application/vnd.api+json")
    assert canonical_body(first) == canonical_body(second)


def test_excluded_fields_top_level_and_dotted_are_left_out() -> None:
    exclude = ["client_ts", "meta.sent_at"]
    first = json_request('{"amount": 1, "client_ts": 1, "meta": {"sent_at": 1, "kept": 1}}')
    second = json_request('{"amount": 1, "client_ts": 2, "meta": {"sent_at": 2, "kept": 1}}')
    third = json_request('{"amount": 1, "client_ts": 2, "meta": {"sent_at": 2, "kept": 2}}')
    assert fingerprint(first, exclude)["body"] == fingerprint(second, exclude)["body"]
    assert fingerprint(first, exclude)["body"] != fingerprint(third, exclude)["body"]
    # Without the exclusion the volatile fields count.
    assert fingerprint(first)["body"] != fingerprint(second)["body"]


def test_excluding_a_field_that_is_missing_or_not_an_object_is_harmless() -> None:
    request = json_request('[1, {"meta": 3}]')
    assert canonical_body(request, ["meta.sent_at", "absent"]) == b'json:[1,{"meta":3}]'


FALLBACK_BODIES = {
    "invalid JSON": b'{"amount": ',
    "not UTF-8": b'{"amount": "\xff\xfe"}',
    "too many digits": b'{"amount": ' + b"9" * 5000 + b"}",
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "empty": b"",
}


@pytest.mark.parametrize("raw", FALLBACK_BODIES.values(), ids=FALLBACK_BODIES.keys())
def test_unparseable_json_falls_back_to_the_raw_bytes(raw: bytes) -> None:
    assert canonical_body(json_request(raw)) == b"raw:" + raw


def test_form_body_fingerprint_ignores_pair_order_but_not_values() -> None:
    def form(body: str) -> Any:
        return factory.post("/x/", body, content_type="application/x-www-form-urlencoded")

    assert canonical_body(form("a=1&b=2&b=3")) == canonical_body(form("b=2&a=1&b=3"))
    assert canonical_body(form("a=1&b=2")) != canonical_body(form("a=1&b=3"))
    assert canonical_body(form("a=1&ts=1"), ["ts"]) == canonical_body(form("a=1&ts=2"), ["ts"])


def multipart(content: bytes, **fields: str) -> Any:
    upload = SimpleUploadedFile("receipt.txt", content, content_type="text/plain")
    return factory.post("/x/", {**fields, "receipt": upload})


def test_multipart_fingerprint_covers_fields_and_file_digests() -> None:
    same = canonical_body(multipart(b"content", amount="1", note="x"))
    assert canonical_body(multipart(b"content", note="x", amount="1")) == same
    assert canonical_body(multipart(b"other content", amount="1", note="x")) != same
    assert canonical_body(multipart(b"content", amount="2", note="x")) != same


def test_multipart_file_is_still_readable_after_fingerprinting() -> None:
    request = multipart(b"the whole file")
    canonical_body(request)
    assert request.FILES["receipt"].read() == b"the whole file"


def test_body_forms_are_tagged_so_they_never_collide() -> None:
    as_json = canonical_body(json_request("[]"))
    as_raw = canonical_body(factory.post("/x/", "[]", content_type="text/plain"))
    assert as_json != as_raw


def test_query_string_fingerprint_ignores_parameter_order() -> None:
    first = factory.post("/x/?a=1&b=2", "", content_type="text/plain")
    second = factory.post("/x/?b=2&a=1", "", content_type="text/plain")
    third = factory.post("/x/?a=1&b=3", "", content_type="text/plain")
    assert fingerprint(first)["query"] == fingerprint(second)["query"]
    assert fingerprint(first)["query"] != fingerprint(third)["query"]


def test_meaningful_headers_are_parts_named_header_and_lowercased() -> None:
    request = json_request("{}", headers={"X-Account": "acct_1"})
    parts = fingerprint(request, headers=["X-Account"])
    assert parts["header:x-account"] == hashlib.sha256(b"acct_1").hexdigest()


def test_differing_names_parts_in_a_stable_order() -> None:
    stored = {"method": "1", "path": "1", "query": "1", "body": "1", "header:x-a": "1"}
    current = {"method": "2", "path": "1", "query": "2", "body": "2", "header:x-a": "2"}
    assert differing(stored, current) == ["method", "query", "body", "header:x-a"]
    assert differing(stored, dict(stored)) == []


# Through views: what a client sees.

ENDPOINTS = pytest.mark.parametrize("path", ["/drf/", "/plain/"])


@pytest.mark.django_db
@ENDPOINTS
def test_same_json_body_in_a_different_key_order_is_replayed(client, path: str) -> None:
    key = new_key()
    script = ScriptFactory(amount=2499, currency="inr", meta={"a": 1, "b": [1, {"x": 1, "y": 2}]})
    first = send(client, "POST", path, json.dumps(script), key=key)
    retry = send(client, "POST", path, json.dumps(reordered(script), indent=1), key=key)
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1


def assert_key_reused(response: Any, parts: list[str]) -> None:
    assert response.status_code == 422, response.content
    body = problem(response)
    assert body["type"].endswith("key-reused")
    assert body["differing"] == parts


@pytest.mark.django_db
@ENDPOINTS
def test_changed_body_is_422_naming_only_the_body(client, path: str) -> None:
    key, script = new_key(), ScriptFactory(amount=2499)
    send(client, "POST", path, script, key=key)
    response = send(client, "POST", path, {**script, "amount": 9999}, key=key)
    assert_key_reused(response, ["body"])
    # The differing values themselves are never echoed.
    assert b"9999" not in response.content
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
def test_changed_method_is_422_naming_only_the_method(client) -> None:
    key, script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", script, key=key)
    response = send(client, "PATCH", "/drf/", script, key=key)
    assert_key_reused(response, ["method"])
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
@ENDPOINTS
def test_changed_query_is_422_naming_only_the_query(client, path: str) -> None:
    key, script = new_key(), ScriptFactory()
    send(client, "POST", f"{path}?expand=customer", script, key=key)
    response = send(client, "POST", f"{path}?expand=invoice", script, key=key)
    assert_key_reused(response, ["query"])
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
@ENDPOINTS
def test_same_key_on_another_endpoint_is_422_naming_the_path(client, path: str) -> None:
    key, script = new_key(), ScriptFactory()
    send(client, "POST", path, script, key=key)
    response = send(client, "POST", f"{path}other/", script, key=key)
    assert_key_reused(response, ["path"])
    assert CALLS[script["tag"]] == 1
    assert IdempotencyRecord.objects.get(key=key).path == path


@pytest.mark.django_db
def test_several_changed_parts_are_all_named(client) -> None:
    key, script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", script, key=key)
    response = send(client, "PATCH", "/drf/other/?page=2", {**script, "x": 1}, key=key)
    assert_key_reused(response, ["method", "path", "query", "body"])


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/excluding/", "/plain/excluding/"])
def test_excluded_fields_are_ignored_top_level_and_dotted(client, path: str) -> None:
    key = new_key()
    script = ScriptFactory(amount=1, client_ts="10:00", meta={"sent_at": "10:00", "note": "a"})
    first = send(client, "POST", path, script, key=key)
    later = {**script, "client_ts": "10:05", "meta": {"sent_at": "10:05", "note": "a"}}
    retry = send(client, "POST", path, later, key=key)
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    changed = {**later, "meta": {"sent_at": "10:05", "note": "b"}}
    assert_key_reused(send(client, "POST", path, changed, key=key), ["body"])
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
def test_excluded_fields_of_one_view_count_on_another(client) -> None:
    key, script = new_key(), ScriptFactory(client_ts="10:00")
    send(client, "POST", "/drf/", script, key=key)
    response = send(client, "POST", "/drf/", {**script, "client_ts": "10:05"}, key=key)
    assert_key_reused(response, ["body"])


@pytest.mark.django_db
def test_meaningful_header_change_is_422_naming_the_header(client) -> None:
    key, script = new_key(), ScriptFactory()
    path = "/drf/header-fingerprint/"
    send(client, "POST", path, script, key=key, headers={"X-Account": "acct_1"})
    same = send(client, "POST", path, script, key=key, headers={"X-Account": "acct_1"})
    assert same["Idempotent-Replayed"] == "true"
    response = send(client, "POST", path, script, key=key, headers={"X-Account": "acct_2"})
    assert_key_reused(response, ["header:x-account"])
    assert b"acct_2" not in response.content
    assert CALLS[script["tag"]] == 1


@pytest.mark.django_db
def test_other_headers_are_not_part_of_the_fingerprint(client) -> None:
    key, script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", script, key=key, headers={"X-Account": "acct_1"})
    retry = send(client, "POST", "/drf/", script, key=key, headers={"X-Account": "acct_2"})
    assert retry["Idempotent-Replayed"] == "true"


@pytest.mark.django_db
def test_global_fingerprint_headers_setting_applies(client, settings) -> None:
    settings.IDEMPOTENCY_FINGERPRINT_HEADERS = ["X-Account"]
    key, script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", script, key=key, headers={"X-Account": "acct_1"})
    response = send(client, "POST", "/drf/", script, key=key, headers={"X-Account": "acct_2"})
    assert_key_reused(response, ["header:x-account"])


def form_post(client: Any, path: str, body: str, key: str) -> Any:
    return client.post(
        path, body, content_type="application/x-www-form-urlencoded",
        headers={"Idempotency-Key": key},
    )  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/upload/", "/plain/"])
def test_form_body_in_another_order_is_replayed_and_a_changed_one_is_422(client, path: str) -> None:
    key, tag = new_key(), new_key()
    first = form_post(client, f"{path}?tag={tag}", "amount=1&currency=inr", key)
    retry = form_post(client, f"{path}?tag={tag}", "currency=inr&amount=1", key)
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    changed = form_post(client, f"{path}?tag={tag}", "currency=inr&amount=2", key)
    assert_key_reused(changed, ["body"])
    assert CALLS[tag] == 1


@pytest.mark.django_db
def test_multipart_with_the_same_file_is_replayed_and_another_file_is_422(client) -> None:
    key, tag = new_key(), new_key()

    def upload(content: bytes) -> Any:
        receipt = SimpleUploadedFile("receipt.txt", content, content_type="text/plain")
        return client.post(
            f"/drf/upload/?tag={tag}", {"amount": "1", "receipt": receipt},
            headers={"Idempotency-Key": key},
        )  # fmt: skip

    first = upload(b"receipt #1")
    assert first.status_code == 201
    # The view read the whole file after the fingerprint did.
    assert first.json()["files"] == {"receipt": hashlib.sha256(b"receipt #1").hexdigest()}
    assert first.json()["fields"] == [["amount", "1"]]
    retry = upload(b"receipt #1")
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert_key_reused(upload(b"receipt #2"), ["body"])
    assert CALLS[tag] == 1


@pytest.mark.django_db
@pytest.mark.parametrize("raw", FALLBACK_BODIES.values(), ids=FALLBACK_BODIES.keys())
def test_unparseable_json_body_through_a_view_is_not_a_500_and_replays(client, raw: bytes) -> None:
    key, tag = new_key(), new_key()
    first = send(client, "POST", f"/plain/?tag={tag}", raw, key=key)
    retry = send(client, "POST", f"/plain/?tag={tag}", raw, key=key)
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert CALLS[tag] == 1


@pytest.mark.django_db
def test_invalid_json_on_a_drf_view_gets_the_parser_400_stored_and_replayed(client) -> None:
    key, tag = new_key(), new_key()
    first = send(client, "POST", f"/drf/?tag={tag}", b'{"amount": ', key=key)
    retry = send(client, "POST", f"/drf/?tag={tag}", b'{"amount": ', key=key)
    assert first.status_code == 400
    assert retry.status_code == 400
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content


@pytest.mark.django_db
def test_large_json_body_is_fingerprinted_and_replayed(client) -> None:
    key = new_key()
    script = ScriptFactory(items=[{"sku": f"sku-{n}", "qty": n} for n in range(40_000)])
    first = send(client, "POST", "/drf/", script, key=key)
    retry = send(client, "POST", "/drf/", json.dumps(reordered(script)), key=key)
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert CALLS[script["tag"]] == 1
