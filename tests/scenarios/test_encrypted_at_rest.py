"""Contract 8a: stored responses sealed at rest, over HTTP, with rotation and re-encryption."""

from __future__ import annotations

import base64
import os
import zlib

import pytest
import zstandard
from django.core.management import CommandError, call_command

from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage import bodies, sealing
from tests.factories import ScriptFactory, new_key
from tests.support.client import problem, replayed, send
from tests.support.views import CALLS, business_rows

pytestmark = [pytest.mark.urls("tests.support.urls"), pytest.mark.django_db]

ENDPOINTS = pytest.mark.parametrize("path", ["/drf/", "/plain/"])


def new_secret() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def key_id(secret: str) -> str:
    return sealing.key_id(base64.b64decode(secret))


@pytest.fixture
def app_compresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodies, "database_compresses", lambda using: False)


@ENDPOINTS
@pytest.mark.parametrize("pad", [0, 300_000], ids=["small", "large"])
def test_with_keys_set_the_response_is_stored_sealed_and_replayed_byte_identical(
    client, settings, path: str, pad: int
) -> None:
    secret = new_secret()
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [secret]
    key, script = new_key(), ScriptFactory(pad=pad, headers={"Location": "/charges/42/"})
    first = send(client, "POST", path, script, key=key)
    retry = send(client, "POST", path, script, key=key)
    assert replayed(retry)
    assert (retry.status_code, retry.content) == (first.status_code, first.content)
    assert retry["Location"] == "/charges/42/"
    assert retry["Content-Type"] == first["Content-Type"]
    record = IdempotencyRecord.objects.get(key=key)
    assert record.body_encoding.startswith("@" + key_id(secret))
    assert record.response_headers is None
    stored = bytes(record.response_body)
    assert script["tag"].encode() not in stored
    assert b"/charges/42/" not in stored
    if pad:
        # Compressed before it was sealed, even where PostgreSQL would compress it itself.
        assert sealing.inner_encoding(record.body_encoding) == bodies.compression(None)
        assert len(stored) < len(first.content) // 10
    assert CALLS[script["tag"]] == 1


@ENDPOINTS
@pytest.mark.parametrize(
    ("codec", "coding", "decompress"),
    [("zlib", "deflate", zlib.decompress), ("zstd", "zstd", zstandard.decompress)],
)
def test_a_sealed_compressed_replay_goes_out_compressed_to_clients_that_accept_it(
    client, settings, path: str, codec, coding, decompress
) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    settings.IDEMPOTENCY_BODY_COMPRESSION = codec
    key, script = new_key(), ScriptFactory(pad=64_000)
    first = send(client, "POST", path, script, key=key)
    encoded = send(client, "POST", path, script, key=key, headers={"Accept-Encoding": coding})
    plain = send(client, "POST", path, script, key=key)
    assert encoded["Content-Encoding"] == coding
    assert decompress(encoded.content) == first.content
    assert plain.content == first.content
    assert "Content-Encoding" not in plain


@ENDPOINTS
@pytest.mark.parametrize(
    "keys", [["not base64!"], [base64.b64encode(b"short").decode()], "duplicate"]
)
def test_a_malformed_key_refuses_the_request_before_the_view_runs_and_never_stores_plain(
    client, settings, caplog, path: str, keys
) -> None:
    if keys == "duplicate":
        secret = new_secret()
        keys = [secret, secret]
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = keys
    key, script = new_key(), ScriptFactory()
    response = send(client, "POST", path, script, key=key)
    assert response.status_code == 500
    assert problem(response)["type"].endswith("misconfigured")
    assert CALLS[script["tag"]] == 0
    assert business_rows(script["tag"]) == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert "Fix IDEMPOTENCY_ENCRYPTION_KEYS" in caplog.text


def test_rotation_the_first_key_seals_and_every_listed_key_opens(client, settings) -> None:
    old, new = new_secret(), new_secret()
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [old]
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", "/drf/", script, key=key)
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new, old]
    assert send(client, "POST", "/drf/", script, key=key).content == first.content
    later, later_script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", later_script, key=later)
    assert IdempotencyRecord.objects.get(key=key).body_encoding == "@" + key_id(old)
    assert IdempotencyRecord.objects.get(key=later).body_encoding == "@" + key_id(new)


def test_a_record_no_listed_key_opens_is_refused_and_never_run_again(
    client, settings, caplog
) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    key, script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", script, key=key)
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    retry = send(client, "POST", "/drf/", script, key=key)
    assert retry.status_code == 500
    assert problem(retry)["type"].endswith("misconfigured")
    assert CALLS[script["tag"]] == 1
    assert "is not among IDEMPOTENCY_ENCRYPTION_KEYS" in caplog.text
    # Turning encryption off does not turn the record into a fresh key either.
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = []
    assert send(client, "POST", "/drf/", script, key=key).status_code == 500
    assert CALLS[script["tag"]] == 1


def test_a_body_moved_into_another_record_is_refused(client, settings, caplog) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    victim, victim_script = new_key(), ScriptFactory()
    thief, thief_script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", victim_script, key=victim)
    send(client, "POST", "/drf/", thief_script, key=thief)
    taken = IdempotencyRecord.objects.get(key=victim)
    IdempotencyRecord.objects.filter(key=thief).update(
        response_body=taken.response_body, body_encoding=taken.body_encoding
    )
    retry = send(client, "POST", "/drf/", thief_script, key=thief)
    assert retry.status_code == 500
    assert victim_script["tag"].encode() not in retry.content
    assert "failed authentication" in caplog.text


@pytest.mark.parametrize("lookup_first", [False, True])
def test_records_stored_plain_before_keys_were_set_are_refused_until_reencrypt_seals_them(
    client, settings, caplog, lookup_first: bool
) -> None:
    settings.IDEMPOTENCY_LOOKUP_FIRST = lookup_first
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", "/drf/", script, key=key)
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]

    refused = send(client, "POST", "/drf/", script, key=key)
    assert refused.status_code == 500 and problem(refused)["type"].endswith("misconfigured")
    assert script["tag"].encode() not in refused.content
    assert "idempotency_reencrypt" in caplog.text
    assert CALLS[script["tag"]] == 1  # never run again either
    call_command("idempotency_reencrypt")
    retry = send(client, "POST", "/drf/", script, key=key)
    assert replayed(retry) and retry.content == first.content


def forge(key: str, **fields: object) -> None:
    IdempotencyRecord.objects.filter(key=key).update(**fields)


@pytest.mark.parametrize(
    "forgery",
    [
        pytest.param(
            {"response_body": b'{"id":999999,"forged":true}', "body_encoding": ""}, id="plain"
        ),
        pytest.param({"body_encoding": ""}, id="encoding-cleared"),
        pytest.param({"body_encoding": "zlib"}, id="encoding-zlib"),
        pytest.param({"body_encoding": "gzip"}, id="unknown-encoding"),
        pytest.param({"response_body": b"short"}, id="envelope-too-short"),
    ],
)
def test_with_keys_set_a_record_that_is_not_sealed_as_written_is_refused_never_replayed(
    client, settings, caplog, forgery: dict[str, object]
) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    key, script = new_key(), ScriptFactory()
    send(client, "POST", "/drf/", script, key=key)
    sealed = bytes(IdempotencyRecord.objects.get(key=key).response_body)
    forge(key, **forgery)

    retry = send(client, "POST", "/drf/", script, key=key)

    assert retry.status_code == 500
    assert problem(retry)["type"].endswith("misconfigured")
    assert b"forged" not in retry.content and sealed not in retry.content
    assert "Idempotent-Replayed" not in retry
    assert CALLS[script["tag"]] == 1
    assert any(r.levelname in ("ERROR", "CRITICAL") for r in caplog.records)


def test_lookup_first_opens_sealed_records_too(client, settings) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    settings.IDEMPOTENCY_LOOKUP_FIRST = True
    key, script = new_key(), ScriptFactory()
    first = send(client, "POST", "/drf/", script, key=key)
    retry = send(client, "POST", "/drf/", script, key=key)
    assert replayed(retry)
    assert retry.content == first.content


@pytest.mark.usefixtures("app_compresses")
def test_reencrypt_seals_plain_and_old_records_under_the_first_key_and_is_idempotent(
    client, settings, capsys
) -> None:
    old, new = new_secret(), new_secret()
    plain = [(new_key(), ScriptFactory(pad=pad)) for pad in (0, 4096)]
    # Plain records are refused once keys are set, until sealed: their answers from before.
    answers = {key: send(client, "POST", "/plain/", script, key=key) for key, script in plain}
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [old]
    sealed_old = [(new_key(), ScriptFactory(pad=pad)) for pad in (0, 4096, 0)]
    for key, script in sealed_old:
        answers[key] = send(client, "POST", "/drf/", script, key=key)
    everything = plain + sealed_old
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new, old]

    call_command("idempotency_reencrypt", "--batch-size", "2")
    out = capsys.readouterr().out
    assert "Re-encrypted 5 record(s) under key " + key_id(new) in out
    assert "(2 plain, 3 under other keys) in 3 batch(es)" in out
    for record in IdempotencyRecord.objects.filter(key__in=[k for k, _ in everything]):
        assert record.body_encoding.startswith("@" + key_id(new))
        assert record.response_headers is None
    # The old key can go: every record opens under the new one.
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new]
    for key, script in everything:
        retry = send(client, "POST", path_of(key, plain), script, key=key)
        assert replayed(retry)
        assert retry.content == answers[key].content
        assert retry["Content-Type"] == answers[key]["Content-Type"]
    call_command("idempotency_reencrypt")
    assert "Re-encrypted 0 record(s)" in capsys.readouterr().out


def path_of(key: str, plain: list[tuple[str, object]]) -> str:
    return "/plain/" if key in {k for k, _ in plain} else "/drf/"


def test_reencrypt_resumes_after_a_record_id(client, settings, capsys) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    keys = [new_key() for _ in range(3)]
    for key in keys:
        send(client, "POST", "/drf/", ScriptFactory(), key=key)
    ids = sorted(IdempotencyRecord.objects.filter(key__in=keys).values_list("id", flat=True))
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret(), *settings.IDEMPOTENCY_ENCRYPTION_KEYS]
    call_command("idempotency_reencrypt", "--after", str(ids[0]))
    assert "Re-encrypted 2 record(s)" in capsys.readouterr().out
    first = IdempotencyRecord.objects.get(id=ids[0])
    assert sealing.sealed_under(first.body_encoding) == key_id(
        settings.IDEMPOTENCY_ENCRYPTION_KEYS[1]
    )


def test_reencrypt_reports_records_no_listed_key_opens_and_leaves_them(
    client, settings, capsys
) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    key = new_key()
    send(client, "POST", "/drf/", ScriptFactory(), key=key)
    before = IdempotencyRecord.objects.get(key=key)
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = [new_secret()]
    with pytest.raises(CommandError, match="1 record"):
        call_command("idempotency_reencrypt")
    assert f"Record {before.id} left as it is" in capsys.readouterr().err
    after = IdempotencyRecord.objects.get(key=key)
    assert bytes(after.response_body) == bytes(before.response_body)


@pytest.mark.parametrize(("keys", "message"), [([], "is empty"), (["nope!"], "is not base64")])
def test_reencrypt_refuses_without_a_key_to_seal_under(settings, keys, message) -> None:
    settings.IDEMPOTENCY_ENCRYPTION_KEYS = keys
    with pytest.raises(CommandError, match=message):
        call_command("idempotency_reencrypt")
