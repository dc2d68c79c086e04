from __future__ import annotations

import http.client
import json
import re
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import AnonymousUser
from django.test import RequestFactory
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from django_idempotency.engine.errors import InvalidKey
from django_idempotency.engine.identity import ANONYMOUS, parse_key, principal_for
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
