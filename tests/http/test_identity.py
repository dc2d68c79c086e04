"""Identity of a request (http/identity.py): the key's syntax (contract 2), the principal
(contract 3) and the fingerprint (contract 4)."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import io
import json
import logging
import re
import time
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

import pytest
from django.contrib.auth.models import AnonymousUser, Group
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import RequestFactory
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rest_framework.parsers import JSONParser

from django_idempotency.engine.errors import InvalidKey, PrincipalMissing
from django_idempotency.engine.work import differing
from django_idempotency.http.identity import (
    ANONYMOUS,
    canonical_body,
    fingerprint,
    parse_key,
    principal_for,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import digests
from tests.factories import IdempotencyRecordFactory, ScriptFactory, UserFactory, new_key
from tests.support.client import problem, send
from tests.support.views import CALLS

pytestmark = pytest.mark.urls("tests.support.urls")

# The contract's key alphabet (section 2), written out independently of keys.py.
KEY_ALPHABET = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '",;\\')
valid_keys = st.text(alphabet=KEY_ALPHABET, min_size=1, max_size=255)


# RFC 8941's parameters (section 3.1.2), written out from the RFC's ABNF: a key, then
# optionally "=" and a bare item (integer, decimal, string, token, byte sequence, boolean).
SF_BARE_ITEM = (
    r"-?[0-9]{1,12}\.[0-9]{1,3}|-?[0-9]{1,15}"  # decimal | integer
    r'|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"'  # string
    r"|[A-Za-z*][-!#$%&'*+.^_`|~0-9A-Za-z:/]*"  # token
    r"|:[A-Za-z0-9+/=]*:"  # byte sequence
    r"|\?[01]"  # boolean
)
SF_PARAMETERS = rf"(?:[ \t]*;[ ]*[a-z*][a-z0-9_.*-]*(?:=(?:{SF_BARE_ITEM}))?)*"


def contract_key(raw: str) -> str | None:
    """What section 2 says the key of a header value is; None when it is invalid."""
    value = raw.strip(" \t")
    if value.startswith('"'):
        # Whitespace before a ";" is tolerated, as it always was; nothing else outside RFC 8941.
        match = re.fullmatch(rf'"([^"]*)"{SF_PARAMETERS}', value, flags=re.DOTALL)
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
    # RFC 8941 parameters that do not parse.
    "empty parameter": '"abc";;',
    "semicolon alone": '"abc";',
    "parameter without a key": '"abc";=1',
    "upper-case parameter key": '"abc";Foo=1',
    "parameter key starting with a digit": '"abc";1a=1',
    "parameter without a value after =": '"abc";a=',
    "comma after a parameter": '"abc";a=1, "def"',
    "comma in a token value": '"abc";a=x,y',
    "unterminated string value": '"abc";a="x',
    "integer of 16 digits": '"abc";a=1234567890123456',
    "decimal with 4 fraction digits": '"abc";a=1.2345',
    "decimal ending in a dot": '"abc";a=1.',
    "bad boolean": '"abc";a=?2',
    "non-ASCII value": '"abc";a="é"',
    "bad byte sequence": '"abc";a=:ab!:',
    "tab after the semicolon": '"abc";\ta=1',
}

VALID_WITH_PARAMETERS = [
    '"k";a="x,y"',
    '"k";a="x;y=\\"z\\""',
    '"k";a=?1;b=?0;c=:AQID:;d=tok/en:x;e=-1.5;f=123456789012345;g;*h=*',
    '"k";  spaced=1',
    '"k" ;a=1 ;b=2',
]


@pytest.mark.parametrize("raw", VALID_WITH_PARAMETERS)
def test_quoted_key_with_rfc8941_parameters_is_accepted(raw: str) -> None:
    assert parse_key(raw) == "k"
    assert contract_key(raw) == "k"


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
    st.tuples(valid_keys, st.from_regex(SF_PARAMETERS, fullmatch=True)).map(
        '"{0[0]}"{0[1]}'.format
    ),
    st.tuples(valid_keys, st.text(alphabet=';=,"?:*aZ1.-\\ \t', max_size=12)).map(
        '"{0[0]}";{0[1]}'.format
    ),
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
    with_a_comma = send(client, "POST", path, script, key=f'"{key}";a="x,y"')
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first
    for retry in (quoted, with_parameters, with_a_comma):
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


@pytest.mark.django_db
def test_json_body_fingerprint_changes_with_a_value() -> None:
    first = json_request('{"amount": 2499, "currency": "inr"}')
    second = json_request('{"amount": 2500, "currency": "inr"}')
    assert fingerprint(first)["body"] != fingerprint(second)["body"]


def test_structured_json_content_types_are_canonicalised_too() -> None:
    first = factory.post("/x/", '{"a": 1, "b": 2}', content_type="application/vnd.api+json")
    second = factory.post("/x/", '{"b": 2, "a": 1}', content_type="application/vnd.api+json")
    assert canonical_body(first) == canonical_body(second)


@pytest.mark.django_db
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
    canonical = canonical_body(request, ["meta.sent_at", "absent"])
    assert canonical == b'json:16:application/json;utf-8;[1,{"meta":3}]'


FALLBACK_BODIES = {
    "invalid JSON": b'{"amount": ',
    "not UTF-8": b'{"amount": "\xff\xfe"}',
    "too many digits": b'{"amount": ' + b"9" * 5000 + b"}",
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "empty": b"",
}


@pytest.mark.parametrize("raw", FALLBACK_BODIES.values(), ids=FALLBACK_BODIES.keys())
def test_unparseable_json_falls_back_to_the_raw_bytes(raw: bytes) -> None:
    # RequestFactory sends no Content-Type with an empty body.
    head = b"16:application/json;utf-8;" if raw else b"0:;utf-8;"
    assert canonical_body(json_request(raw)) == b"raw:" + head + raw


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


@pytest.mark.django_db
def test_query_string_fingerprint_ignores_parameter_order() -> None:
    first = factory.post("/x/?a=1&b=2", "", content_type="text/plain")
    second = factory.post("/x/?b=2&a=1", "", content_type="text/plain")
    third = factory.post("/x/?a=1&b=3", "", content_type="text/plain")
    assert fingerprint(first)["query"] == fingerprint(second)["query"]
    assert fingerprint(first)["query"] != fingerprint(third)["query"]


@pytest.mark.django_db
def test_meaningful_headers_are_parts_named_header_and_lowercased() -> None:
    request = json_request("{}", headers={"X-Account": "acct_1"})
    parts = fingerprint(request, headers=["X-Account"])
    key = digests.purpose_key("default", "fingerprint")
    assert parts["header:x-account"] == "h1:" + hmac.new(key, b"acct_1", "sha256").hexdigest()


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


# Principals (contract 3): never None, never shared by accident


def principal_of(value: Any) -> str:
    request = RequestFactory().post("/")
    request.user = AnonymousUser()
    return principal_for(request, lambda r: value)


@pytest.mark.parametrize("value", [None, "", [], (), set(), frozenset(), {}], ids=repr)
def test_principal_callable_returning_nothing_is_refused(value: Any) -> None:
    with pytest.raises(PrincipalMissing):
        principal_of(value)


# Ids that do not change between processes (an object's repr holds its address), so that
# parallel workers collect the same tests.
@pytest.mark.parametrize(
    "value",
    [True, False, 1.5, b"tenant", object()],
    ids=["True", "False", "1.5", "bytes", "object"],
)
def test_principal_callable_returning_a_value_that_cannot_name_a_principal_is_refused(
    value: Any,
) -> None:
    # A bool merges everybody into two scopes; an object's str() may change between requests.
    with pytest.raises(PrincipalMissing):
        principal_of(value)


def test_principal_callable_returning_an_unsaved_instance_is_refused() -> None:
    with pytest.raises(PrincipalMissing):
        principal_of(Group(name="acme"))


@pytest.mark.django_db
def test_model_instances_are_identified_by_model_and_primary_key_not_str() -> None:
    user, group = UserFactory(username="acme"), Group.objects.create(name="acme")
    # Equal str(), different models: two principals.
    assert str(user) == str(group)
    assert principal_of(user) == f"auth.user:{user.pk}"
    assert principal_of(group) == f"auth.group:{group.pk}"
    # The same row fetched twice is one principal.
    assert principal_of(Group.objects.get(pk=group.pk)) == principal_of(group)


def test_values_of_different_types_never_share_a_principal() -> None:
    uuid = UUID("4f1c7a9e-0b7d-4c1e-9d0a-6a2f3e8b1c55")
    values = [1, "1", "int:1", "str:1", "str:int:1", uuid, str(uuid), f"uuid:{uuid}", "user:7",
              "anonymous", "auth.user:7", "sha256:" + "0" * 64]  # fmt: skip
    principals = [principal_of(value) for value in values]
    assert len(set(principals)) == len(values), principals
    # Neither a string nor an int can pass for the default principals.
    assert ANONYMOUS not in principals
    assert "user:7" not in principals


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["tenant:\x00", "tenant:\ud800", "t" * 300])
def test_a_principal_the_database_cannot_hold_is_stored_by_its_digest(value: str) -> None:
    principal = principal_of(value)
    assert principal.startswith("sha256:")
    IdempotencyRecordFactory(scope=principal)
    assert IdempotencyRecord.objects.filter(scope=principal).exists()


def test_plain_strings_keep_their_readable_form() -> None:
    assert principal_of("tenant:acme") == "tenant:acme"
    assert principal_of(42) == "int:42"


principal_values = st.one_of(
    st.integers(), st.text(min_size=1, max_size=300), st.uuids(), st.tuples(st.integers())
)


@given(principal_values, principal_values)
@example("t" * 299 + "u", "t" * 300)
@example(1, "1")
def test_distinct_principal_values_never_share_a_scope(first: Any, second: Any) -> None:
    if isinstance(first, tuple) or isinstance(second, tuple):
        # A collection is not a principal; it is refused, whatever it holds.
        with pytest.raises(PrincipalMissing):
            principal_of(first if isinstance(first, tuple) else second)
        return
    same = type(first) is type(second) and first == second
    assert (principal_of(first) == principal_of(second)) is same
    assert len(principal_of(first)) <= 255


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_principal_callable_returning_none_is_a_500_and_never_a_shared_scope(
    client, settings, path: str
) -> None:
    # The reproduction: users without a tenant all got the scope "None".
    settings.IDEMPOTENCY_PRINCIPAL = lambda request: getattr(request.user, "tenant_id", None)
    key, script = new_key(), ScriptFactory()
    alice = send(client, "POST", path, script, key=key)
    bob = send(client, "POST", path, script, key=key)
    for response in (alice, bob):
        assert response.status_code == 500, response.content
        body = problem(response)
        assert body["type"].endswith("principal-missing")
        assert body["title"] == "The view's principal callable returned no principal"
    assert CALLS[script["tag"]] == 0
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "view"),
    [("/drf/", "tests.support.views.ScriptedView"), ("/plain/", "tests.support.views._plain")],
)
def test_principal_callable_returning_none_logs_an_error_naming_the_view(
    client, settings, caplog: pytest.LogCaptureFixture, path: str, view: str
) -> None:
    # Contract 3: the refusal is not only a 500 for the client, the operator is told where.
    settings.IDEMPOTENCY_PRINCIPAL = lambda request: None
    with caplog.at_level(logging.ERROR, logger="django_idempotency"):
        response = send(client, "POST", path, ScriptFactory(), key=new_key())
    assert response.status_code == 500
    errors = [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.ERROR and record.name == "django_idempotency"
    ]
    assert any(f"view {view}" in message for message in errors), errors


# Exact fingerprints (contract 4)


def body_digest(raw: str | bytes, content_type: str = "application/json") -> str:
    # generic() sends the bytes as they are; post() would re-encode them to the charset.
    return fingerprint(factory.generic("POST", "/x/", raw, content_type=content_type))["body"]


@pytest.mark.parametrize(
    "first, second",
    [
        ("12345678901234567.01", "12345678901234567.99"),
        ("1e400", "9e999"),
        ("-1e400", "1e400"),
        ("1e-400", "0"),
        ("0.1", "0.10000000000000001"),
        ("1e999999999", "1e999999998"),
        ("123456789012345678901234567890", "123456789012345678901234567891"),
    ],
)
def test_json_numbers_that_differ_in_value_never_share_a_fingerprint(
    first: str, second: str
) -> None:
    assert body_digest(f'{{"note": {first}}}') != body_digest(f'{{"note": {second}}}')


@pytest.mark.parametrize(
    "spellings",
    [
        ["1", "1.0", "1.00", "10e-1", "0.1e1", "100E-2", "1e0"],
        ["0", "-0", "0.0", "-0.0", "0e5", "0E-9"],
        ["2500", "2.5e3", "25E+2", "2500.000", "2.5e+003", "25000e-1"],
        ["-0.5", "-5e-1", "-0.50"],
        ["1e400", "10e399", "1.0E+400"],
        ["1000000000000000000000", "1e21", "1.000e21"],
    ],
)
def test_json_numbers_of_equal_value_share_a_fingerprint(spellings: list[str]) -> None:
    digests = {body_digest(f'{{"note": {number}}}') for number in spellings}
    assert len(digests) == 1


finite_decimals = st.decimals(allow_nan=False, allow_infinity=False)


def padded(value: Decimal) -> str:
    """The same number spelled with one more trailing zero."""
    mantissa, e, exponent = str(value).partition("E")
    return mantissa + ("0" if "." in mantissa else ".0") + e + exponent


@given(finite_decimals, finite_decimals)
@example(Decimal("1"), Decimal("1.0"))
@example(Decimal("12345678901234567.01"), Decimal("12345678901234567.99"))
@example(Decimal("-0"), Decimal("0E-30"))
def test_json_numbers_share_a_fingerprint_exactly_when_their_values_are_equal(
    first: Decimal, second: Decimal
) -> None:
    assert (body_digest(f"[{first}]") == body_digest(f"[{second}]")) is (first == second)
    assert body_digest(f"[{first}]") == body_digest(f"[{padded(first)}]")


HUGE_NUMBERS = ["1e999999999", "-1e-999999999", "9" * 4000 + "e999999999", "1e" + "9" * 4000,
                "1e4299", "1" + "0" * 4299]  # fmt: skip


@pytest.mark.parametrize("number", HUGE_NUMBERS, ids=lambda n: n[:12])
def test_a_huge_number_is_fingerprinted_in_constant_time(number: str) -> None:
    started = time.perf_counter()
    digest = body_digest(f'{{"note": {number}}}')
    assert time.perf_counter() - started < 0.05
    assert digest != body_digest(f'{{"note": {number}1}}')


def test_a_body_of_many_huge_numbers_costs_about_what_parsing_it_costs() -> None:
    # 1e4299 as an int would be 4,300 digits, a millisecond each to write out.
    raw = "[" + ",".join(["1e4299"] * 20_000) + "]"
    started = time.perf_counter()
    body_digest(raw)
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize(
    "first, second",
    [
        ('{"a": 1}', '{"a": "1"}'),
        ('{"a": 0.5}', '{"a": {"\\u0000": "5E-1"}}'),
        ('{"a": 100000000000000000000}', '{"a": {"\\u0000": "1E20"}}'),
        ('{"\\u0000": 1}', '{"\\u0000\\u0000": 1}'),
        ('{"\\u0000": "5E-1"}', "0.5"),
        ("[true]", "[1]"),
        ("[null]", "[0]"),
        ("[NaN]", '["NaN"]'),
    ],
)
def test_json_values_of_different_kinds_never_share_a_fingerprint(first: str, second: str) -> None:
    assert body_digest(first) != body_digest(second)


def test_duplicated_json_keys_mean_the_last_one_as_drf_parses_them() -> None:
    raw = b'{"amount": 1, "amount": 2}'
    assert JSONParser().parse(io.BytesIO(raw)) == {"amount": 2}
    assert body_digest(raw) == body_digest(b'{"amount": 2}')
    assert body_digest(raw) != body_digest(b'{"amount": 1}')


def test_the_charset_is_part_of_the_body() -> None:
    raw = '{"note": "\u00e9"}'.encode()
    as_utf8 = body_digest(raw, "application/json; charset=utf-8")
    # The same bytes that DRF decodes as "Ã©".
    assert as_utf8 != body_digest(raw, "application/json; charset=latin-1")
    # JSON without a charset is UTF-8, for DRF as for json.loads.
    assert as_utf8 == body_digest(raw, "application/json")
    assert as_utf8 == body_digest(raw, "application/json; charset=UTF8")
    text = "caf\u00e9".encode()
    assert body_digest(text, "text/plain; charset=utf-8") != body_digest(
        text, "text/plain; charset=latin-1"
    )


def test_json_in_another_charset_is_compared_byte_for_byte() -> None:
    # Under latin-1 an escaped "\u00c3\u00a9" and the raw bytes C3 A9 are the same string to
    # DRF, but not to a view that reads the bytes: they never share a fingerprint.
    latin = "application/json; charset=latin-1"
    assert body_digest(b'"\\u00c3\\u00a9"', latin) != body_digest(b'"\xc3\xa9"', latin)
    assert body_digest(b'{"a": 1}', latin) == body_digest(b'{"a": 1}', latin)


def test_the_media_type_is_part_of_the_body() -> None:
    assert body_digest(b"<a/>", "text/plain") != body_digest(b"<a/>", "application/xml")
    assert body_digest(b"{}", "application/json") != body_digest(b"{}", "application/vnd.api+json")


def test_a_file_part_never_collides_with_a_text_field() -> None:
    content = b"receipt"
    digest = hashlib.sha256(content).hexdigest()
    as_file = factory.post("/x/", {"receipt": SimpleUploadedFile("x.txt", content, "text/plain")})
    as_field = factory.post("/x/", {"receipt": f"file:x.txt:{digest}"})
    assert canonical_body(as_file) != canonical_body(as_field)


def test_a_file_part_counts_its_name_and_content_type() -> None:
    def upload(name: str, content_type: str) -> bytes:
        return canonical_body(
            factory.post("/x/", {"receipt": SimpleUploadedFile(name, b"same", content_type)})
        )

    assert upload("a.txt", "text/plain") != upload("b.txt", "text/plain")
    assert upload("a.txt", "text/plain") != upload("a.txt", "text/csv")


@pytest.mark.django_db
def test_the_order_of_repeated_form_fields_and_query_parameters_counts() -> None:
    def form(body: str, query: str = "") -> Any:
        return factory.post(f"/x/?{query}", body, content_type="application/x-www-form-urlencoded")

    # request.POST.getlist("b") is [2, 3] for one and [3, 2] for the other.
    assert canonical_body(form("b=2&b=3")) != canonical_body(form("b=3&b=2"))
    assert fingerprint(form("", "b=2&b=3"))["query"] != fingerprint(form("", "b=3&b=2"))["query"]
    assert fingerprint(form("", "a=1&b=2"))["query"] == fingerprint(form("", "b=2&a=1"))["query"]


@pytest.mark.django_db
def test_an_empty_query_and_a_missing_query_are_one_value() -> None:
    assert fingerprint(factory.post("/x/?"))["query"] == fingerprint(factory.post("/x/"))["query"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
def test_a_retry_with_a_number_that_differs_after_the_16th_digit_is_422(client, path: str) -> None:
    key, tag = new_key(), new_key()
    first = send(client, "POST", path, f'{{"tag": "{tag}", "note": 12345678901234567.01}}', key=key)
    other = send(client, "POST", path, f'{{"tag": "{tag}", "note": 12345678901234567.99}}', key=key)
    same = send(
        client, "POST", path, f'{{"note": 1234567890123456701e-2, "tag": "{tag}"}}', key=key
    )
    assert first.status_code == 201
    assert_key_reused(other, ["body"])
    assert same["Idempotent-Replayed"] == "true"
    assert CALLS[tag] == 1


@pytest.mark.django_db
def test_a_retry_with_the_same_bytes_in_another_charset_is_422(client) -> None:
    key, tag = new_key(), new_key()
    raw = f'{{"tag": "{tag}", "note": "\u00e9"}}'.encode()
    first = send(
        client, "POST", "/drf/", raw, key=key, content_type="application/json; charset=utf-8"
    )
    other = send(
        client, "POST", "/drf/", raw, key=key, content_type="application/json; charset=latin-1"
    )
    assert first.status_code == 201
    assert_key_reused(other, ["body"])


# The negotiated media type (contract 4, for views with several renderers)


@pytest.mark.django_db
def test_the_negotiated_media_type_is_a_part_named_header_accept() -> None:
    request = json_request("{}")
    html = fingerprint(request, media_type="text/html")
    as_json = fingerprint(request, media_type="application/json")
    assert "header:accept" not in fingerprint(request)
    assert html["header:accept"] != as_json["header:accept"]
    assert differing(html, as_json) == ["header:accept"]
    assert differing(html, fingerprint(request, media_type="text/html")) == []


# No anonymous claim with credentials (contract 3, 15): a keyed request whose principal is
# the anonymous one while it carries credentials is refused before the claim.


def misconfigured(response: Any) -> bool:
    return response.status_code == 500 and problem(response)["type"].endswith("misconfigured")


def logged_in_client() -> Any:
    from django.test import Client

    client = Client()
    client.force_login(UserFactory())
    return client


@pytest.mark.parametrize(
    "authorization",
    ["Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b", "Bearer eyJhbGciOi.x.y", "Basic YTpi",
     "Digest username=\"a\"", "ApiKey k", "opaque"],
)  # fmt: skip
@pytest.mark.django_db
def test_an_anonymous_key_with_an_authorization_header_of_any_scheme_is_refused(
    client: Any, authorization: str, caplog: pytest.LogCaptureFixture
) -> None:
    script, key = ScriptFactory(), new_key()
    response = send(client, "POST", "/plain/identified/", script, key=key,
                    headers={"Authorization": authorization})  # fmt: skip
    assert misconfigured(response)
    assert "an Authorization header" in problem(response)["detail"]
    assert CALLS[script["tag"]] == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    (logged,) = [r for r in caplog.records if r.levelname == "ERROR" and "anonymous" in r.message]
    assert "tests.support.views._plain" in logged.message
    assert "POST /plain/identified/" in logged.message
    assert "below the view's authentication decorator" in logged.message
    assert "principal callable" in logged.message and "allow_anonymous=True" in logged.message


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": " "}, {"X-Api-Key": "alice-key"}, {"X-Api-Key": "wrong"},
     {"Cookie": "sessionid=no-such-session"}],
    ids=["nothing", "empty-authorization", "api-key", "wrong-api-key", "unknown-session"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/plain/identified/", "/drf/identified/", "/drf/token-only/"])
@pytest.mark.django_db
def test_an_anonymous_key_is_refused_whatever_it_carries_unless_the_view_opts_in(
    client: Any, path: str, headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # Credentials the app cannot recognise (an API key header) or none at all: the key would
    # be claimed in one scope shared by every anonymous caller, so it is refused.
    script, key = ScriptFactory(), new_key()
    response = send(client, "POST", path, script, key=key, headers=headers)
    assert misconfigured(response)
    assert CALLS[script["tag"]] == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert any(f"POST {path}" in r.message for r in caplog.records if r.levelname == "ERROR")
    # Without a key, nothing is claimed: the view runs.
    assert send(client, "POST", path, script).status_code == 201


@pytest.mark.django_db
def test_an_anonymous_key_runs_in_the_anonymous_scope_where_the_view_allows_it(
    client: Any,
) -> None:
    script, key = ScriptFactory(), new_key()
    assert send(client, "POST", "/plain/anonymous-keys/", script, key=key).status_code == 201
    assert IdempotencyRecord.objects.get(key=key).scope == ANONYMOUS


@pytest.mark.django_db
def test_the_session_cookie_of_a_logged_in_session_on_an_anonymous_key_is_refused() -> None:
    # The view authenticates by token only: the logged-in session does not make its client
    # known, and the key would be claimed for the anonymous principal.
    client, script, key = logged_in_client(), ScriptFactory(), new_key()
    response = send(client, "POST", "/drf/token-only/", script, key=key)
    assert misconfigured(response)
    assert "session cookie of a logged-in session" in problem(response)["detail"]
    assert CALLS[script["tag"]] == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.django_db
def test_a_logged_in_session_without_authentication_middleware_is_refused() -> None:
    from django.test import override_settings

    from testproject.settings import MIDDLEWARE

    client, script = logged_in_client(), ScriptFactory()
    without = [m for m in MIDDLEWARE if not m.endswith("AuthenticationMiddleware")]
    with override_settings(MIDDLEWARE=without):
        response = send(client, "POST", "/plain/identified/", script, key=new_key())
    assert misconfigured(response)
    assert CALLS[script["tag"]] == 0


@pytest.mark.django_db
def test_credentials_of_an_authenticated_principal_are_no_concern(client: Any) -> None:
    user = UserFactory()
    client.force_login(user)
    script, key = ScriptFactory(), new_key()
    response = send(client, "POST", "/plain/", script, key=key,
                    headers={"Authorization": "Bearer x"})  # fmt: skip
    assert response.status_code == 201
    assert IdempotencyRecord.objects.get(key=key).scope == f"user:{user.pk}"


@pytest.mark.django_db
def test_a_principal_callable_scopes_keys_whatever_credentials_come_along(client: Any) -> None:
    script = ScriptFactory()
    response = send(client, "POST", "/plain/tenant/", script, key=new_key(),
                    headers={"Authorization": "Basic YTpi", "X-Tenant": "acme"})  # fmt: skip
    assert response.status_code == 201


@pytest.mark.parametrize(
    ("path", "session"),
    [("/plain/anonymous-keys/", False), ("/drf/anonymous-keys/", False),
     ("/drf/anonymous-keys/", True)],
)  # fmt: skip
@pytest.mark.django_db
def test_allow_anonymous_lets_a_view_take_anonymous_keys_with_credentials(
    path: str, session: bool
) -> None:
    from django.test import Client

    client, script, key = logged_in_client() if session else Client(), ScriptFactory(), new_key()
    response = send(client, "POST", path, script, key=key,
                    headers={"Authorization": "Signature keyId=\"sender\""})  # fmt: skip
    assert response.status_code == 201
    assert IdempotencyRecord.objects.get(key=key).scope == ANONYMOUS


@pytest.mark.django_db
def test_a_ninja_operation_without_auth_refuses_an_anonymous_key_with_credentials(
    client: Any,
) -> None:
    pytest.importorskip("ninja")
    tag, key = new_key(), new_key()
    headers = {"Authorization": "Bearer x"}
    response = send(client, "POST", f"/ninja/open/?tag={tag}", key=key, headers=headers)
    assert misconfigured(response)
    assert CALLS[tag] == 0
    allowed = send(client, "POST", f"/ninja/anonymous-keys/?tag={tag}", key=key, headers=headers)
    assert allowed.status_code == 200 and CALLS[tag] == 1
