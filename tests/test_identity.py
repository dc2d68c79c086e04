"""Identity of a request (engine/identity.py): the key's syntax (contract 2), the principal
(contract 3) and the fingerprint (contract 4)."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import RequestFactory
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from django_idempotency.engine.errors import InvalidKey
from django_idempotency.engine.identity import (
    ANONYMOUS,
    canonical_body,
    differing,
    fingerprint,
    parse_key,
    principal_for,
)
from django_idempotency.models import IdempotencyRecord
from tests.client import problem, send
from tests.factories import ScriptFactory, UserFactory, new_key
from tests.views import CALLS

pytestmark = pytest.mark.urls("tests.urls")

# The contract's key alphabet (section 2), written out independently of keys.py.
KEY_ALPHABET = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '",;\\')
valid_keys = st.text(alphabet=KEY_ALPHABET, min_size=1, max_size=255)


def contract_key(raw: str) -> str | None:
    """What section 2 says the key of a header value is; None when it is invalid."""
    value = raw.strip(" \t")
    if value.startswith('"'):
        match = re.fullmatch(r'"([^"]*)"[ \t]*(?:;[^,]*)?', value, flags=re.DOTALL)
        if match is None:
            return None
        value = match.group(1)
    if not 1 <= len(value) <= 255 or any(c not in KEY_ALPHABET for c in value):
        return None
    return value


MALFORMED = {
    "empty": "",
    "empty quoted": '""',
    "only spaces": "   ",
    "256 characters": "k" * 256,
    "256 characters quoted": '"' + "k" * 256 + '"',
    "inner space": "abc def",
    "tab inside": "abc\tdef",
    "control character": "abc\x00def",
    "newline": "abc\ndef",
    "delete character": "abc\x7fdef",
    "non-ASCII": "clé-42",
    "non-ASCII quoted": '"clé-42"',
    "latin-1 byte": "abc\xffdef",
    "comma list": "key-one, key-two",
    "comma list without space": "key-one,key-two",
    "two header lines joined": '"key-one", "key-two"',
    "quoted list": '"key-one","key-two"',
    "escaped quote": r'"ab\"cd"',
    "escaped backslash": r'"ab\\cd"',
    "backslash bare": r"ab\cd",
    "unterminated string": '"abcdef',
    "garbage after string": '"abcdef" junk',
    "parameters on a bare value": "abcdef;param=1",
    "quote inside a bare value": 'ab"cd',
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_parse_key_rejects_malformed_values(raw: str) -> None:
    with pytest.raises(InvalidKey):
        parse_key(raw)


def test_quoted_and_bare_forms_parse_to_the_same_key() -> None:
    key = "4f1c7a9e-0b7d-4c1e-9d0a-6a2f3e8b1c55"
    assert parse_key(key) == parse_key(f'"{key}"') == key


def test_parameters_after_a_quoted_key_are_ignored() -> None:
    assert parse_key('"abc-123";foo=1;bar') == "abc-123"
    assert parse_key('"abc-123" ; foo="x"') == "abc-123"


def test_key_of_255_characters_is_accepted_and_256_is_not() -> None:
    assert parse_key("k" * 255) == "k" * 255
    with pytest.raises(InvalidKey):
        parse_key("k" * 256)


def test_surrounding_whitespace_is_not_part_of_the_key() -> None:
    assert parse_key("  abc-123\t") == "abc-123"


@given(valid_keys)
def test_every_valid_key_parses_to_itself_bare_and_quoted(key: str) -> None:
    assert parse_key(key) == key
    assert parse_key(f'"{key}"') == key
    assert parse_key(f'"{key}";p=1') == key


header_values = st.one_of(
    st.text(),
    # What a WSGI server hands over: header bytes decoded as latin-1.
    st.binary().map(lambda raw: raw.decode("latin-1")),
    st.text(alphabet=KEY_ALPHABET + ' \t",;\\\x00\x7f\xe9', max_size=300),
    valid_keys,
    valid_keys.map(lambda key: f'"{key}"'),
    st.lists(valid_keys, min_size=2, max_size=4).map(", ".join),
    st.text(alphabet=KEY_ALPHABET, min_size=256, max_size=400),
)


@given(header_values)
@example("k" * 256)
@example('"a", "b"')
def test_parse_key_accepts_exactly_the_contract_alphabet(raw: str) -> None:
    expected = contract_key(raw)
    if expected is None:
        with pytest.raises(InvalidKey):
            parse_key(raw)
    else:
        assert parse_key(raw) == expected


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_key_gets_400_invalid_key_and_the_view_does_not_run(
    client, path: str, raw: str
) -> None:
    script = ScriptFactory()
    response = send(client, "POST", path, script, key=raw)
    assert response.status_code == 400
    body = problem(response)
    assert body["type"].endswith("invalid-key")
    assert body["status"] == 400
    assert CALLS[script["tag"]] == 0
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=header_values)
@example(raw="k" * 256)
@example(raw="abc\x00def")
@example(raw='"one", "two"')
def test_any_header_value_through_a_view_is_executed_or_400_invalid_key_never_500(
    client, raw: str
) -> None:
    # One body for every example: a valid key seen twice is replayed, not reused.
    response = send(client, "POST", "/drf/", {"tag": "hypothesis"}, key=raw)
    if contract_key(raw) is None:
        assert response.status_code == 400, response.content
        assert problem(response)["type"].endswith("invalid-key")
    else:
        assert response.status_code == 201, response.content


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_quoted_and_bare_forms_are_the_same_key_through_a_view(client, path: str) -> None:
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", path, script, key=key)
    quoted = send(client, "POST", path, script, key=f'"{key}"')
    with_parameters = send(client, "POST", path, script, key=f'"{key}";client=sdk-1')
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first
    for retry in (quoted, with_parameters):
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_header_lines_joined_by_the_server_are_400_invalid_key(live_server) -> None:
    script = ScriptFactory()
    url = urlsplit(live_server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = json.dumps(script).encode()
    connection.putrequest("POST", "/drf/")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(len(body)))
    connection.putheader("Idempotency-Key", "key-one")
    connection.putheader("Idempotency-Key", "key-two")
    connection.endheaders(body)
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    assert response.status == 400
    assert response.getheader("Content-Type") == "application/problem+json"
    assert payload["type"].endswith("invalid-key")
    assert not IdempotencyRecord.objects.exists()


def test_principal_is_anonymous_without_an_authenticated_user() -> None:
    request = RequestFactory().post("/")
    request.user = AnonymousUser()
    assert principal_for(request, None) == ANONYMOUS


@pytest.mark.django_db
def test_principal_is_the_authenticated_user() -> None:
    request = RequestFactory().post("/")
    request.user = UserFactory()
    assert principal_for(request, None) == f"user:{request.user.pk}"


def test_principal_callable_wins_over_the_user() -> None:
    request = RequestFactory().post("/", headers={"X-Tenant": "acme"})
    request.user = AnonymousUser()
    assert principal_for(request, lambda r: "tenant:" + r.headers["X-Tenant"]) == "tenant:acme"


def test_long_principal_is_hashed_to_fit_the_column_and_stays_distinct() -> None:
    request = RequestFactory().post("/")
    first = principal_for(request, lambda r: "t" * 300)
    second = principal_for(request, lambda r: "t" * 299 + "u")
    assert len(first) <= 255
    assert first.startswith("sha256:")
    assert first != second


@pytest.mark.django_db
def test_keys_are_case_sensitive(client) -> None:
    script = ScriptFactory()
    send(client, "POST", "/drf/", script, key="Key-ABC")
    other = send(client, "POST", "/drf/", script, key="key-abc")
    assert "Idempotent-Replayed" not in other
    assert CALLS[script["tag"]] == 2


# Fingerprint

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
