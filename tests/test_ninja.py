"""Django Ninja: ``idempotent_operation`` on the testproject's ``POST /ninja/charges/``
(token authentication, the payments handler), through Django's test client and over HTTP."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import requests
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection
from django.http import HttpRequest
from django.test import Client
from django.urls import path

from django_idempotency.models import IdempotencyRecord
from testproject.payments import executions
from testproject.payments.models import Charge
from tests.support.client import problem, replayed, send
from tests.support.views import CALLS

ninja = pytest.importorskip("ninja")
from ninja.errors import HttpError  # noqa: E402
from ninja.operation import AsyncOperation, Operation  # noqa: E402
from ninja.security import APIKeyHeader, django_auth  # noqa: E402
from ninja.throttling import AuthRateThrottle  # noqa: E402

from django_idempotency.ninja import (  # noqa: E402
    AsyncIdempotentOperation,
    IdempotentOperation,
    idempotent_operation,
)
from testproject.ninja_api import DRFToken  # noqa: E402

pytestmark = pytest.mark.django_db

URL = "/ninja/charges/"
# The same charge as a sync and as an async operation.
BOTH = pytest.mark.parametrize("url", [URL, "/ninja/charges/async/"], ids=["sync", "async"])
CHARGE = {"amount": 2499, "currency": "inr"}


def charge(user: Any, key: str | None, body: Any = CHARGE, url: str = URL, **headers: str) -> Any:
    if user is not None:
        headers["Authorization"] = f"Token {user.token}"
    client = Client(raise_request_exception=False)
    return send(client, "POST", url, body, key=key, headers=headers)


def records(key: str) -> list[IdempotencyRecord]:
    return list(IdempotencyRecord.objects.filter(key=key))


def runs() -> int:
    count = executions.count(Charge)
    assert count is not None
    return count


@BOTH
def test_fresh_key_runs_once_and_the_retry_is_replayed_byte_for_byte(
    token_user: Any, url: str
) -> None:
    key, before = str(uuid.uuid4()), runs()

    first = charge(token_user, key, url=url)
    retry = charge(token_user, key, url=url)

    assert first.status_code == 201, first.content
    assert not replayed(first)
    assert first.json()["user"] == token_user.user.username
    assert (retry.status_code, replayed(retry)) == (201, True)
    assert retry.content == first.content
    assert retry["Content-Type"] == first["Content-Type"]
    assert runs() - before == 1
    assert Charge.objects.filter(user=token_user.user).count() == 1
    [record] = records(key)
    assert record.scope == f"user:{token_user.user.pk}"


def test_authentication_runs_before_the_claim_and_before_a_replay(
    token_user: Any, make_token_user: Any
) -> None:
    key = str(uuid.uuid4())
    refused = charge(None, key)
    assert refused.status_code == 401
    assert records(key) == []  # nothing claimed for a client that never authenticated

    assert charge(token_user, key).status_code == 201
    for credentials in ({}, {"Authorization": "Token wrong"}):
        retry = send(Client(), "POST", URL, CHARGE, key=key, headers=credentials)
        assert (retry.status_code, replayed(retry)) == (401, False)
        assert b"2499" not in retry.content

    # Another client's same key is its own: it runs, and never sees the first answer.
    other = charge(make_token_user(), key)
    assert (other.status_code, replayed(other)) == (201, False)
    assert len(records(key)) == 2


def test_a_reused_key_with_another_body_is_refused_with_a_problem(token_user: Any) -> None:
    key = str(uuid.uuid4())
    assert charge(token_user, key).status_code == 201

    reused = charge(token_user, key, {**CHARGE, "amount": 100})

    assert reused.status_code == 422
    assert problem(reused)["type"].endswith("key-reused")
    assert Charge.objects.filter(user=token_user.user).count() == 1


def test_a_missing_key_is_refused_after_authentication(token_user: Any) -> None:
    assert charge(None, None).status_code == 401
    missing = charge(token_user, None)
    assert missing.status_code == 400
    assert problem(missing)["type"].endswith("missing-key")


@pytest.mark.parametrize(
    ("body", "status"),
    [
        # Ninja's own validation of the schema: the operation never runs.
        ({"amount": "lots", "currency": "inr"}, 422),
        # The payments serializer's, turned into a 400 by the API's exception handler.
        ({"amount": 2499, "currency": "12"}, 400),
    ],
    ids=["ninja-422", "handler-400"],
)
def test_a_4xx_that_ninja_renders_is_stored_and_replayed(
    token_user: Any, body: dict[str, Any], status: int
) -> None:
    key = str(uuid.uuid4())

    first = charge(token_user, key, body)
    retry = charge(token_user, key, body)

    assert (first.status_code, replayed(first)) == (status, False)
    assert first["Content-Type"].startswith("application/json")
    assert (retry.status_code, replayed(retry), retry.content) == (status, True, first.content)
    [record] = records(key)
    assert record.response_code == status
    assert not Charge.objects.filter(user=token_user.user).exists()


@BOTH
@pytest.mark.parametrize("debug", [False, True], ids=["raised", "debug-500-page"])
def test_an_exception_rolls_everything_back_and_the_retry_executes(
    token_user: Any, settings: Any, debug: bool, url: str
) -> None:
    # Under DEBUG Ninja answers the exception with a traceback page instead of raising it.
    settings.DEBUG = debug
    key, before = str(uuid.uuid4()), runs()
    body = {**CHARGE, "fail_once": str(uuid.uuid4())}  # raises after writing, once

    failed = charge(token_user, key, body, url)

    assert failed.status_code == 500
    assert not Charge.objects.filter(user=token_user.user).exists()
    assert records(key) == []
    retry = charge(token_user, key, body, url)
    assert (retry.status_code, replayed(retry)) == (201, False)
    assert runs() - before == 2
    assert Charge.objects.filter(user=token_user.user).count() == 1
    assert len(records(key)) == 1


@pytest.mark.django_db(transaction=True)
def test_under_atomic_requests_too(token_user: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    key = str(uuid.uuid4())
    body = {**CHARGE, "fail_once": str(uuid.uuid4())}

    assert charge(token_user, key, body).status_code == 500
    assert not Charge.objects.filter(user=token_user.user).exists()
    assert records(key) == []
    first = charge(token_user, key, body)
    retry = charge(token_user, key, body)
    assert (first.status_code, retry.status_code, replayed(retry)) == (201, 201, True)
    assert retry.content == first.content
    assert Charge.objects.filter(user=token_user.user).count() == 1
    invalid = {"amount": "lots", "currency": "inr"}
    key = str(uuid.uuid4())
    assert charge(token_user, key, invalid).status_code == 422
    assert replayed(charge(token_user, key, invalid))


@BOTH
@pytest.mark.parametrize("server", ["live_gunicorn", "live_uvicorn"])
@pytest.mark.django_db(transaction=True)
def test_parallel_identical_requests_over_http_execute_once(
    request: pytest.FixtureRequest, make_token_user: Any, server: str, url: str
) -> None:
    from tests.support.payments import counts, send_at_once

    base_url = request.getfixturevalue(server)
    user, key = make_token_user(), str(uuid.uuid4())
    # Long enough for all ten to arrive while the first holds the key: those that overlap it
    # get 409 at once (waiting is off by default), the later ones its replay.
    body = {**CHARGE, "delay_ms": 500}
    before = counts(base_url)

    def post() -> requests.Response:
        return requests.post(
            base_url + url, json=body, timeout=30,
            headers={**user.headers, "Idempotency-Key": key},
        )  # fmt: skip

    answers = send_at_once([post] * 10)

    statuses = Counter((a.status_code, replayed(a)) for a in answers)
    assert set(statuses) <= {(201, False), (201, True), (409, False)}, statuses
    assert statuses[(201, False)] == 1, statuses
    assert len({a.content for a in answers if a.status_code == 201}) == 1
    assert counts(base_url) - before == (1, 1)
    assert Charge.objects.filter(user=user.user).count() == 1
    assert len(records(key)) == 1


# The other ways to write and mount an operation, on an API of this module's own.


class ClientName(APIKeyHeader):
    """An auth that returns a name, not a user."""

    param_name = "X-Client"

    def authenticate(self, request: HttpRequest, key: str | None) -> str | None:
        return key or None


class StoreDown(APIKeyHeader):
    """An auth whose database query fails, as when the database is unreachable."""

    param_name = "X-Client"

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        raise OperationalError("connection to server was lost")


tests_api = ninja.NinjaAPI(urls_namespace="ninja-tests", auth=DRFToken(), docs_url=None)
reused_router = ninja.Router()


def counted(request: HttpRequest, tag: str) -> dict[str, int]:
    return {"execution": CALLS.hit(tag)}


@idempotent_operation  # above the operation's decorator: the operation exists already
@tests_api.post("/above/", response={201: dict[str, int]})
def above(request: HttpRequest, tag: str) -> Any:
    return ninja.Status(201, counted(request, tag))


@tests_api.post("/throttled/", throttle=AuthRateThrottle("1/h"))
@idempotent_operation
def throttled(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


@tests_api.post("/refused/", response={402: dict[str, str]})
@idempotent_operation
def refused(request: HttpRequest, tag: str) -> Any:
    CALLS.hit(tag)
    raise HttpError(402, "Payment required.")


@tests_api.post("/async/", response={201: dict[str, Any]})
@idempotent_operation
async def charge_async(request: HttpRequest, amount: int, fail: str = "") -> Any:
    charge = await Charge.objects.acreate(amount=amount, currency="inr", user=request.auth)
    await sync_to_async(CALLS.hit)(f"async:{amount}")
    if fail:
        raise RuntimeError("failed after writing")
    return ninja.Status(201, {"id": charge.pk})


@tests_api.post("/by-name/", auth=ClientName())
@idempotent_operation
def by_name(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


@tests_api.post("/by-name-scoped/", auth=ClientName())
@idempotent_operation(principal=lambda request: request.auth)
def by_name_scoped(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


@tests_api.post("/open/", auth=None)
@idempotent_operation(allow_anonymous=True)
def open_to_all(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


@tests_api.post("/session/", auth=django_auth)
@idempotent_operation
def by_session(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


@tests_api.post("/store-down/", auth=StoreDown())
@idempotent_operation
def store_down(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


@tests_api.post(
    "/extra/",
    openapi_extra={
        "parameters": [{"in": "header", "name": "X-Trace", "schema": {"type": "string"}}],
        "responses": {418: {"description": "A teapot."}},
    },
)
@idempotent_operation
def with_extra(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


@tests_api.get("/read/")
@idempotent_operation  # GET is not covered by default: nothing to document
def read(request: HttpRequest) -> Any:
    return {}


@reused_router.post("/reused/")
@idempotent_operation
def reused(request: HttpRequest, tag: str) -> Any:
    return counted(request, tag)


tests_api.add_router("/a/", reused_router, url_name_prefix="a")
tests_api.add_router("/b/", reused_router, url_name_prefix="b")
urlpatterns = [path("t/", tests_api.urls)]
on_tests_api = pytest.mark.urls(__name__)


def post(path: str, key: str | None, user: Any = None, **headers: str) -> Any:
    if user is not None:
        headers["Authorization"] = f"Token {user.token}"
    return send(Client(raise_request_exception=False), "POST", path, key=key, headers=headers)


@on_tests_api
def test_the_decorator_works_above_the_operations_decorator_too(token_user: Any) -> None:
    key, tag = str(uuid.uuid4()), str(uuid.uuid4())
    first = post(f"/t/above/?tag={tag}", key, token_user)
    retry = post(f"/t/above/?tag={tag}", key, token_user)
    assert (first.status_code, retry.status_code, replayed(retry)) == (201, 201, True)
    assert retry.content == first.content
    assert post(f"/t/above/?tag={tag}", key).status_code == 401
    assert CALLS[tag] == 1


@on_tests_api
def test_throttles_run_before_a_replay(token_user: Any) -> None:
    key, tag = str(uuid.uuid4()), str(uuid.uuid4())
    first = post(f"/t/throttled/?tag={tag}", key, token_user)
    retry = post(f"/t/throttled/?tag={tag}", key, token_user)
    assert (first.status_code, replayed(first)) == (200, False)
    assert (retry.status_code, replayed(retry)) == (429, False)
    assert CALLS[tag] == 1
    assert len(records(key)) == 1


@on_tests_api
def test_an_http_error_is_stored_and_replayed(token_user: Any) -> None:
    key, tag = str(uuid.uuid4()), str(uuid.uuid4())
    first = post(f"/t/refused/?tag={tag}", key, token_user)
    retry = post(f"/t/refused/?tag={tag}", key, token_user)
    assert (first.status_code, replayed(first)) == (402, False)
    assert (retry.status_code, replayed(retry), retry.content) == (402, True, first.content)
    assert CALLS[tag] == 1


@on_tests_api
def test_a_router_mounted_twice_is_protected_at_each_mount(token_user: Any) -> None:
    key, tag = str(uuid.uuid4()), str(uuid.uuid4())
    assert post(f"/t/a/reused/?tag={tag}", key, token_user).status_code == 200
    assert replayed(post(f"/t/a/reused/?tag={tag}", key, token_user))
    # The same key on the other mount is another request: the key is bound to its first.
    other = post(f"/t/b/reused/?tag={tag}", key, token_user)
    assert other.status_code == 422
    assert problem(other)["differing"] == ["path"]
    assert CALLS[tag] == 1


@on_tests_api
def test_an_async_operation_writes_in_the_claims_transaction(token_user: Any) -> None:
    amount = 1000 + CALLS.hit("async-amount")
    key = str(uuid.uuid4())
    failed = post(f"/t/async/?amount={amount}&fail=1", key, token_user)
    assert failed.status_code == 500
    assert not Charge.objects.filter(amount=amount).exists()
    assert records(key) == []

    key = str(uuid.uuid4())
    first = post(f"/t/async/?amount={amount}", key, token_user)
    retry = post(f"/t/async/?amount={amount}", key, token_user)
    assert (first.status_code, retry.status_code, replayed(retry)) == (201, 201, True)
    assert retry.content == first.content
    assert Charge.objects.filter(amount=amount).count() == 1
    assert CALLS[f"async:{amount}"] == 2  # the failed run and the first; not the replay


@on_tests_api
def test_an_auth_that_returns_no_user_needs_a_principal(caplog: Any) -> None:
    key, tag = str(uuid.uuid4()), str(uuid.uuid4())
    with pytest.raises(ImproperlyConfigured, match="principal="):
        send(Client(), "POST", f"/t/by-name/?tag={tag}", key=key, headers={"X-Client": "a"})
    assert CALLS[tag] == 0
    assert records(key) == []

    answers = [
        post(f"/t/by-name-scoped/?tag={tag}", key, **{"X-Client": name})
        for name in ("alice", "bob", "alice")
    ]
    assert [(a.status_code, replayed(a)) for a in answers] == [
        (200, False),
        (200, False),
        (200, True),
    ]
    assert {record.scope for record in records(key)} == {"alice", "bob"}
    assert CALLS[tag] == 2


@on_tests_api
def test_a_request_without_a_key_passes_through_when_none_is_required(token_user: Any) -> None:
    tag = str(uuid.uuid4())
    assert post(f"/t/open/?tag={tag}", None).status_code == 200
    assert post(f"/t/open/?tag={tag}", None).status_code == 200
    amount = 2000 + CALLS.hit("async-amount")
    assert post(f"/t/async/?amount={amount}", None, token_user).status_code == 201
    assert post(f"/t/async/?amount={amount}", None, token_user).status_code == 201
    assert (CALLS[tag], Charge.objects.filter(amount=amount).count()) == (2, 2)
    assert not IdempotencyRecord.objects.filter(path__in=["/t/open/", "/t/async/"]).exists()


@on_tests_api
def test_whose_key_it_is(client: Client, token_user: Any) -> None:
    key, tag = str(uuid.uuid4()), str(uuid.uuid4())
    assert post(f"/t/open/?tag={tag}", key).status_code == 200
    client.force_login(token_user.user)
    assert send(client, "POST", f"/t/session/?tag={tag}", key=key).status_code == 200
    assert {r.path: r.scope for r in records(key)} == {
        "/t/open/": "anonymous",
        "/t/session/": f"user:{token_user.user.pk}",
    }


@on_tests_api
def test_an_unreachable_store_during_authentication_is_a_503() -> None:
    key, tag = str(uuid.uuid4()), str(uuid.uuid4())
    answer = post(f"/t/store-down/?tag={tag}", key, **{"X-Client": "a"})
    assert answer.status_code == 503
    assert problem(answer)["type"].endswith("store-unavailable")
    assert answer["Retry-After"]
    assert CALLS[tag] == 0


def test_an_operation_of_another_class_stays_one() -> None:
    class Custom(Operation):
        pass

    class CustomAsync(AsyncOperation):
        pass

    async def handler(request: HttpRequest) -> None: ...

    for base, mixin in ((Custom, IdempotentOperation), (CustomAsync, AsyncIdempotentOperation)):
        handler.__dict__.pop("_ninja_operation", None)
        operation = base("/x/", ["POST"], handler)
        handler._ninja_operation = operation  # type: ignore[attr-defined]
        idempotent_operation(handler)
        assert isinstance(operation, base) and isinstance(operation, mixin)
        first = type(operation)
        idempotent_operation(required=True)(handler)  # again: the class stays, options change
        assert type(operation) is first
        assert operation.idempotency_options == {"required": True}  # type: ignore[attr-defined]
        assert isinstance(operation.clone(), first)


@on_tests_api
def test_the_openapi_schema_documents_the_key_and_the_errors(settings: Any) -> None:
    paths = Client().get("/t/openapi.json").json()["paths"]
    for route in ("/t/a/reused/", "/t/b/reused/", "/t/above/"):
        operation = paths[route]["post"]
        [header] = [p for p in operation["parameters"] if p["in"] == "header"]
        assert (header["name"], header["required"]) == ("Idempotency-Key", False)
        for status in ("400", "409", "422", "503"):
            assert "application/problem+json" in operation["responses"][status]["content"]
    assert "key-reused" in paths["/t/above/"]["post"]["responses"]["422"]["description"]
    assert "tag" in {p["name"] for p in paths["/t/above/"]["post"]["parameters"]}

    extra = paths["/t/extra/"]["post"]
    assert [p["name"] for p in extra["parameters"]] == ["tag", "Idempotency-Key", "X-Trace"]
    assert extra["responses"]["418"] == {"description": "A teapot."}
    assert not [p for p in paths["/t/read/"]["get"].get("parameters", []) if p["in"] == "header"]

    # Read when the schema is built, from the settings of the moment.
    settings.IDEMPOTENCY_ERROR_FORMAT = "stripe"
    operation = Client().get("/t/openapi.json").json()["paths"]["/t/open/"]["post"]
    assert "422" not in operation["responses"]
    assert "key-reused" in operation["responses"]["400"]["description"]
    assert set(operation["responses"]["400"]["content"]) == {"application/json"}
    settings.IDEMPOTENCY_HEADER = "X-Request-Key"
    settings.IDEMPOTENCY_REQUIRED = True
    settings.IDEMPOTENCY_EXPIRED_WINDOW = timedelta(hours=1)
    operation = Client().get("/t/openapi.json").json()["paths"]["/t/open/"]["post"]
    [header] = [p for p in operation["parameters"] if p["in"] == "header"]
    assert (header["name"], header["required"]) == ("X-Request-Key", True)
    assert "missing-key" in operation["responses"]["400"]["description"]
    assert "key-expired" in operation["responses"]["410"]["description"]


def test_the_testproject_schema_documents_its_charge() -> None:
    operation = Client().get("/ninja/openapi.json").json()["paths"]["/ninja/charges/"]["post"]
    [header] = [p for p in operation["parameters"] if p["in"] == "header"]
    assert (header["name"], header["required"]) == ("Idempotency-Key", True)
    assert {"201", "400", "409", "422", "503"} <= set(operation["responses"])
