"""Hostile input against the payments API: bodies, ``Prefer`` values and header lines from
hypothesis, and oversized requests over real HTTP.

The oracle: every answer is a clear 4xx or a correct execution (a 2xx with exactly one
charge; a retry with the same key answered from the store), never a 5xx, and memory stays
bounded. Where the unprotected baseline (``/api/charges-plain/``) itself fails on a body,
the protected endpoint is held to the baseline's class of answer instead: the library may
add no 5xx of its own.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import threading
import tracemalloc
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import psutil
import pytest
from django.test import Client, override_settings
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testproject.payments.models import Charge
from tests.factories import new_key

PROTECTED, BASELINE, DECORATED = "/api/charges/", "/api/charges-plain/", "/api/charges-django/"
# Amounts no other test uses, so that rows can be told apart.
amounts = itertools.count(70_000_000)
# Body fields the payments API treats as fault switches: crash_once would end the test
# process itself, so generated bodies never carry them.
SWITCHES = frozenset({"fail", "fail_once", "crash_once", "delay_ms"})
# The contract's defaults (tests.settings changes neither).
MAX_WAIT_SECONDS = 10
UNSTORED = frozenset({408, 409, 425, 429})
FUZZ = settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(max_size=8).filter(lambda k: k not in SWITCHES), children, max_size=4
        )
    ),
    max_leaves=25,
)
content_types = st.sampled_from([
    "application/json", "application/json; charset=utf-8", "application/json; charset=latin-1",
    "application/merge-patch+json", "text/plain", "application/octet-stream",
    "application/x-www-form-urlencoded", "multipart/form-data", "",
])  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, str]:
    """A request body and its Content-Type, from well-formed charges to garbage."""
    amount = next(amounts)
    extras = draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in SWITCHES),
                                  json_values, max_size=3))  # fmt: skip
    charge = {**extras, "amount": amount, "currency": "inr"}
    kind = draw(st.sampled_from(["charge", "value", "duplicate keys", "bad utf-8", "raw",
                                 "form", "multipart", "nested"]))  # fmt: skip
    if kind == "charge":
        return json.dumps(charge).encode(), "application/json"
    if kind == "value":
        return json.dumps(draw(json_values)).encode(), draw(content_types)
    if kind == "duplicate keys":
        # Parsers keep the last value; the fingerprint must agree with what the view sees.
        other = draw(st.integers(-5, 10**12))
        return f'{{"amount": {other}, "currency": "inr", "amount": {amount}}}'.encode(), (
            "application/json"
        )
    if kind == "bad utf-8":
        raw = json.dumps(charge).encode()
        at = draw(st.integers(0, len(raw)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]))
        return raw[:at] + junk + raw[at:], "application/json"
    if kind == "raw":
        return draw(st.binary(max_size=300)), draw(content_types)
    if kind == "form":
        pairs = [(k, json.dumps(v)) for k, v in charge.items()]
        return urlencode(pairs).encode(), "application/x-www-form-urlencoded"
    if kind == "multipart":
        files = {"receipt": draw(st.binary(max_size=200))}
        data = {**{k: json.dumps(v) for k, v in charge.items()}, **files}
        return encode_multipart(BOUNDARY, data), MULTIPART_CONTENT
    depth = draw(st.sampled_from([10, 100, 500, 5_000]))
    return ("[" * depth + "]" * depth).encode(), "application/json"


@pytest.fixture
def payer(make_token_user: Any) -> Any:
    return make_token_user()


def post(
    token: str,
    path: str,
    body: bytes,
    content_type: str,
    key: str | None = None,
    **headers: str,
) -> Any:
    """POST through the whole Django stack; a 500 comes back as a response, with its
    exception kept for the assertion message."""
    client = Client(raise_request_exception=False)
    all_headers = {"Authorization": f"Token {token}", **headers}
    if key is not None:
        all_headers["Idempotency-Key"] = key
    # generic() sends the bytes as they are, whatever the content type says.
    return client.generic("POST", path, body, content_type=content_type, headers=all_headers)


def explain(response: Any) -> str:
    exc_info = getattr(response, "exc_info", None)
    cause = f"{exc_info[0].__name__}: {exc_info[1]}" if exc_info else ""
    return f"{response.status_code} {cause} {response.content[:300]!r}"


def charges() -> int:
    return Charge.objects.count()


@pytest.mark.django_db
@FUZZ
@given(body=bodies())
def test_any_body_is_a_4xx_or_one_execution_and_a_retry_is_answered_from_the_store(
    payer: Any, body: tuple[bytes, str]
) -> None:
    raw, content_type = body
    baseline = post(payer.token, BASELINE, raw, content_type)
    before = charges()
    key = new_key()

    first = post(payer.token, PROTECTED, raw, content_type, key)
    executed = charges() - before

    if baseline.status_code < 500:
        assert first.status_code < 500, explain(first)
    assert executed == (1 if 200 <= first.status_code < 300 else 0), explain(first)
    if first.status_code >= 500 or first.status_code in UNSTORED:
        return
    retry = post(payer.token, PROTECTED, raw, content_type, key)
    assert retry.status_code == first.status_code, explain(retry)
    assert charges() - before == executed
    if executed or retry.get("Idempotent-Replayed") == "true":
        # A 4xx that Django gave before the claim (a body it cannot parse) is not stored:
        # nothing ran, so answering it again is as good as replaying it.
        assert retry["Idempotent-Replayed"] == "true", explain(retry)
        assert retry.content == first.content


prefer_values = st.one_of(
    st.text(st.characters(max_codepoint=0x7FF, exclude_characters="\r\n"), max_size=60),
    st.integers(-(10**30), 10**30).map(lambda n: f"wait={n}"),
    st.text(alphabet="0123456789\u00b9\u00b2\u00b3\u0663\uff11.-+ \"'", max_size=30).map(
        lambda s: f"wait={s}"
    ),
    st.lists(
        st.sampled_from(["respond-async", "wait=1", "wait=5", 'wait="3"', "handling=strict",
                         "return=minimal", "wait=99999999999999999999", "wait", "wait=",
                         "WAIT=2", "wait=2;x=y", ";", ",", "wait=-1"]),
        min_size=1, max_size=4,
    ).map(", ".join),
)  # fmt: skip


@pytest.mark.django_db
@FUZZ
@given(prefer=prefer_values)
def test_any_prefer_value_executes_once_and_applies_at_most_the_maximum_wait(
    payer: Any, prefer: str
) -> None:
    body = json.dumps({"amount": next(amounts), "currency": "inr"}).encode()
    key = new_key()
    before = charges()

    first = post(payer.token, PROTECTED, body, "application/json", key, Prefer=prefer)
    retry = post(payer.token, PROTECTED, body, "application/json", key, Prefer=prefer)

    assert first.status_code == 201, explain(first)
    assert (retry.status_code, retry.content) == (201, first.content), explain(retry)
    assert retry["Idempotent-Replayed"] == "true"
    assert charges() - before == 1
    for response in (first, retry):
        applied = response.headers.get("Preference-Applied")
        if applied is not None:
            match = re.fullmatch(r"wait=(\d+)", applied)
            assert match and int(match[1]) <= MAX_WAIT_SECONDS, applied


def test_a_large_form_body_costs_memory_in_proportion_to_its_size(payer: Any, db: None) -> None:
    """Django refuses more than DATA_UPLOAD_MAX_NUMBER_FIELDS form fields (1000) so that a
    body under DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB) cannot cost much more than that in
    memory; the fingerprint must not undo that by parsing every field itself."""
    body = b"a&" * 1_200_000  # 2.4 MB: under the size limit, 1.2 million fields
    tracemalloc.start()
    try:
        response = post(payer.token, PROTECTED, body, "application/x-www-form-urlencoded",
                        new_key())  # fmt: skip
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 400 <= response.status_code < 500, explain(response)
    assert peak < 10 * len(body), f"peak {peak >> 20} MiB for a {len(body) >> 20} MiB body"


@pytest.mark.django_db
@override_settings(DEBUG=True)
@pytest.mark.parametrize("path", [PROTECTED, DECORATED])
def test_an_oversized_body_is_400_also_under_debug(payer: Any, path: str) -> None:
    # Over DATA_UPLOAD_MAX_MEMORY_SIZE: Django's RequestDataTooBig, a 400. Under DEBUG,
    # DRF's error path needs a negotiated renderer, which must not hide it.
    response = post(payer.token, path, b"x" * (3 * 2**20), "application/json", new_key())
    assert response.status_code == 400, explain(response)


@pytest.mark.django_db
@pytest.mark.parametrize("path", [PROTECTED, DECORATED])
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_json_is_a_client_error(payer: Any, path: str, depth: int) -> None:
    before = charges()
    body = ("[" * depth + "]" * depth).encode()
    response = post(payer.token, path, body, "application/json", new_key())
    assert 400 <= response.status_code < 500, explain(response)
    assert charges() == before


# -- over real HTTP: what gunicorn hands to Django, and what a worker holds in memory ------


@pytest.fixture(scope="module")
def server(gunicorn_server: Any) -> Iterator[Any]:
    """One sync worker, so that its memory can be watched."""
    with gunicorn_server(workers=1) as started:
        yield started


def worker_rss(server: Any) -> int:
    return sum(c.memory_info().rss for c in psutil.Process(server.process.pid).children())


def raw_request(
    server: Any, head: bytes, body: Iterable[bytes], timeout: float = 30
) -> tuple[int, bytes]:
    """Send ``head`` then ``body`` chunks as they come; return the status and the answer.
    The server may answer and close before the body is sent: that is allowed."""
    host, port = urlsplit(server.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head)

        def send_body() -> None:
            try:
                for chunk in body:
                    sock.sendall(chunk)
            except OSError:
                pass  # answered and closed early

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        answer = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
        sender.join(timeout)
    match = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    assert match, f"no HTTP answer: {answer[:200]!r}"
    return int(match[1]), answer


def head(
    token: str,
    lines: list[tuple[bytes, bytes]],
    length: int | None,
    *,
    path: str = PROTECTED,
    content_type: bytes = b"application/json",
) -> bytes:
    fields = [
        (b"Host", b"127.0.0.1"),
        (b"Authorization", f"Token {token}".encode()),
        (b"Content-Type", content_type),
        (b"Connection", b"close"),
        *lines,
    ]
    if length is not None:
        fields.append((b"Content-Length", str(length).encode()))
    return f"POST {path} HTTP/1.1\r\n".encode() + b"".join(
        name + b": " + value + b"\r\n" for name, value in fields
    ) + b"\r\n"  # fmt: skip


header_bytes = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
header_lines = st.lists(
    st.tuples(st.sampled_from([b"Idempotency-Key", b"idempotency-key", b"Prefer"]),
              st.one_of(header_bytes, st.uuids().map(lambda u: str(u).encode()),
                        st.uuids().map(lambda u: f'"{u}"'.encode()),
                        st.integers(0, 9000).map(lambda n: b"k" * n))),
    min_size=1, max_size=3,
)  # fmt: skip


@pytest.mark.django_db(transaction=True)
@settings(max_examples=40, suppress_health_check=list(HealthCheck), deadline=None)
@given(lines=header_lines)
def test_any_header_lines_over_http_are_a_4xx_or_one_execution(
    server: Any, payer: Any, lines: list[tuple[bytes, bytes]]
) -> None:
    amount = next(amounts)
    body = json.dumps({"amount": amount, "currency": "inr"}).encode()
    status, answer = raw_request(server, head(payer.token, lines, len(body)), iter([body]))
    assert status < 500, answer[:500]
    rows = Charge.objects.filter(amount=amount).count()
    assert rows == (1 if 200 <= status < 300 else 0), answer[:500]
    keys = [value for name, value in lines if name.lower() == b"idempotency-key"]
    if len(keys) > 1:
        # Several lines reach Django joined by a comma: never a key (contract, section 2),
        # if gunicorn did not refuse them first (431 for an oversized header, say).
        assert 400 <= status < 500, answer[:500]


BIG = 64 * 2**20


def chunks(total: int, size: int = 2**20) -> Iterator[bytes]:
    for _ in range(total // size):
        yield b"[" * size


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_huge_body_is_refused_without_the_worker_holding_it(
    server: Any, payer: Any, framing: str
) -> None:
    before = worker_rss(server)
    if framing == "content-length":
        status, answer = raw_request(
            server, head(payer.token, [(b"Idempotency-Key", new_key().encode())], BIG),
            chunks(BIG),
        )  # fmt: skip
    else:
        lines = [(b"Idempotency-Key", new_key().encode()), (b"Transfer-Encoding", b"chunked")]
        status, answer = raw_request(
            server, head(payer.token, lines, None),
            (b"%x\r\n%s\r\n" % (len(c), c) for c in itertools.chain(chunks(BIG), [b""])),
        )  # fmt: skip
    grown = worker_rss(server) - before
    assert 400 <= status < 500, answer[:500]
    assert grown < 32 * 2**20, f"the worker grew by {grown >> 20} MiB"


UPLOAD = 60 * 2**20
MULTIPART_PATHS = [
    PROTECTED, DECORATED, "/api/charges/async/", "/ninja/charges/", "/ninja/charges/async/"
]  # fmt: skip


def first_part(boundary: bytes = b"zzz") -> Iterator[bytes]:
    """The start of a 60 MiB upload, and then nothing: a server that reads the body waits."""
    yield (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="a.bin"'
        b"\r\nContent-Type: application/octet-stream\r\n\r\n" + b"x" * 2**20
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", MULTIPART_PATHS)
@pytest.mark.parametrize(
    "content_type",
    [b"multipart/form-data; boundary=zzz", b"multipart/form-data", b"multipart/form-data; boundary="
     + b"b" * 250, b'multipart/form-data; boundary="ends in a space "'],
    ids=["well-formed", "no-boundary", "boundary-too-long", "bad-boundary"],
)  # fmt: skip
def test_a_multipart_upload_the_view_cannot_parse_is_415_before_it_is_read(
    server: Any, payer: Any, path: str, content_type: bytes
) -> None:
    # None of these views parses multipart (JSON only), or Django cannot parse the body at
    # all. Only the first MiB of the announced 60 is ever sent: an answer proves that
    # nothing waited to read the rest (today: read, hashed, then a 500).
    key = new_key()
    lines = [(b"Idempotency-Key", key.encode())]
    request_head = head(payer.token, lines, UPLOAD, path=path, content_type=content_type)
    status, answer = raw_request(server, request_head, first_part(), timeout=20)
    assert status == 415, answer[:500]
    from django_idempotency.models import IdempotencyRecord

    assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.django_db
@pytest.mark.urls("tests.support.urls")
def test_a_plain_view_that_reads_no_multipart_answers_415_not_500_and_stores_nothing() -> None:
    from django_idempotency.models import IdempotencyRecord
    from tests.support.views import CALLS

    # Well-formed, so the fingerprint parses it; the view then reads the raw body, which
    # Django no longer has: that view takes no multipart, and its key stays free.
    key, client = new_key(), Client(raise_request_exception=False)
    body = encode_multipart(BOUNDARY, {"amount": "1"})
    before = CALLS["json-only"]
    for _ in range(2):
        response = client.generic("POST", "/plain/json-only/", body, content_type=MULTIPART_CONTENT,
                                  headers={"Idempotency-Key": key})  # fmt: skip
        assert response.status_code == 415, explain(response)
    assert CALLS["json-only"] - before == 2
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    as_json = client.post("/plain/json-only/", {"amount": 1}, content_type="application/json",
                          headers={"Idempotency-Key": key})  # fmt: skip
    assert as_json.status_code == 201


@pytest.mark.django_db
@pytest.mark.urls("tests.support.urls")
@pytest.mark.parametrize("path", ["/plain/", "/plain/json-only/", "/drf/upload/"])
def test_a_malformed_multipart_body_is_415_before_it_is_read(path: str) -> None:
    from django_idempotency.models import IdempotencyRecord

    key, client = new_key(), Client(raise_request_exception=False)
    response = client.generic("POST", path, b"--zzz\r\n\r\nx", content_type="multipart/form-data",
                              headers={"Idempotency-Key": key})  # fmt: skip
    assert response.status_code == 415, explain(response)
    assert not IdempotencyRecord.objects.filter(key=key).exists()
