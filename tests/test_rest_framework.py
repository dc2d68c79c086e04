"""The DRF glue: access control before replay, content negotiation, viewsets, composition."""

from __future__ import annotations

import json
from typing import Any, get_type_hints

import pytest
import requests
from django.contrib.auth.models import Group
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import override_settings
from rest_framework.authentication import BaseAuthentication
from rest_framework.parsers import JSONParser, MultiPartParser
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.test import APIClient, APIRequestFactory
from rest_framework.views import APIView, exception_handler

from django_idempotency.http.options import OPTION_NAMES, ViewOptions
from django_idempotency.models import IdempotencyRecord
from django_idempotency.rest_framework import IdempotencyMixin
from tests.factories import ScriptFactory, TokenFactory, new_key
from tests.support.claims import held_claim
from tests.support.client import problem, replayed, send
from tests.support.views import CALLS, TRACE, tenant_principal

pytestmark = [pytest.mark.urls("tests.support.urls"), pytest.mark.django_db]


def token_client(token: Any) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def test_authentication_permissions_and_throttles_run_before_a_replay() -> None:
    token, key, script = TokenFactory(), new_key(), ScriptFactory()
    first = send(token_client(token), "POST", "/drf/guarded/", script, key=key)
    assert first.status_code == 201

    anonymous = send(APIClient(), "POST", "/drf/guarded/", script, key=key)
    forbidden = send(
        token_client(token), "POST", "/drf/guarded/", script, key=key, headers={"X-Deny": "yes"}
    )
    throttled = send(
        token_client(token), "POST", "/drf/guarded/", script, key=key,
        headers={"X-Throttle": "deny"},
    )  # fmt: skip
    assert anonymous.status_code == 401
    assert forbidden.status_code == 403
    assert throttled.status_code == 429
    for refused in (anonymous, forbidden, throttled):
        assert not replayed(refused)
        assert refused.content != first.content

    retry = send(token_client(token), "POST", "/drf/guarded/", script, key=key)
    assert replayed(retry)
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1


def test_a_refused_request_does_not_use_up_its_key() -> None:
    token, key, script = TokenFactory(), new_key(), ScriptFactory()
    assert send(APIClient(), "POST", "/drf/guarded/", script, key=key).status_code == 401
    throttled = send(
        token_client(token), "POST", "/drf/guarded/", script, key=key,
        headers={"X-Throttle": "deny"},
    )  # fmt: skip
    assert throttled.status_code == 429
    assert not IdempotencyRecord.objects.exists()
    accepted = send(token_client(token), "POST", "/drf/guarded/", script, key=key)
    assert accepted.status_code == 201
    assert not replayed(accepted)


def test_principal_is_the_user_drf_authenticated_by_token() -> None:
    token, key = TokenFactory(), new_key()
    send(token_client(token), "POST", "/drf/guarded/", ScriptFactory(), key=key)
    assert IdempotencyRecord.objects.get(key=key).scope == f"user:{token.user.pk}"


@pytest.mark.parametrize(
    ("path", "key", "expected"),
    [
        ("/drf/required/", None, "missing-key"),
        ("/drf/", "bad key", "invalid-key"),
    ],
)
def test_client_accepting_only_problem_json_is_served_not_406(
    client, path: str, key: str | None, expected: str
) -> None:
    response = send(
        client, "POST", path, ScriptFactory(), key=key,
        headers={"Accept": "application/problem+json"},
    )  # fmt: skip
    assert response.status_code == 400
    assert problem(response)["type"].endswith(expected)


def test_key_reused_is_served_to_a_client_accepting_only_problem_json(client) -> None:
    key, script = new_key(), ScriptFactory()
    accept = {"Accept": "application/problem+json"}
    send(client, "POST", "/drf/", script, key=key, headers=accept)
    response = send(client, "POST", "/drf/", {**script, "x": 1}, key=key, headers=accept)
    assert response.status_code == 422
    assert problem(response)["differing"] == ["body"]


def test_views_own_responses_still_negotiate_json(client) -> None:
    response = send(client, "POST", "/drf/", ScriptFactory(), key=new_key())
    assert response["Content-Type"] == "application/json"


def test_viewset_create_partial_update_and_custom_post_action_are_covered(client) -> None:
    create_key, name = new_key(), f"g-{new_key()}"
    created = send(client, "POST", "/drf/groups/", {"name": name}, key=create_key)
    assert created.status_code == 201
    assert replayed(send(client, "POST", "/drf/groups/", {"name": name}, key=create_key))
    pk = created.json()["id"]

    patch_key, patched_name = new_key(), f"p-{new_key()}"
    patched = send(client, "PATCH", f"/drf/groups/{pk}/", {"name": patched_name}, key=patch_key)
    assert patched.status_code == 200
    retry = send(client, "PATCH", f"/drf/groups/{pk}/", {"name": patched_name}, key=patch_key)
    assert replayed(retry)

    action_key, renamed = new_key(), f"r-{new_key()}"
    first = send(client, "POST", f"/drf/groups/{pk}/rename/", {"name": renamed}, key=action_key)
    again = send(client, "POST", f"/drf/groups/{pk}/rename/", {"name": renamed}, key=action_key)
    assert replayed(again)
    assert again.content == first.content

    for name_ in (name, patched_name, renamed):
        assert CALLS[f"viewset:{name_}"] == 1


def test_viewset_put_is_not_covered_by_default(client) -> None:
    pk = send(client, "POST", "/drf/groups/", {"name": f"g-{new_key()}"}).json()["id"]
    key, name = new_key(), f"u-{new_key()}"
    send(client, "PUT", f"/drf/groups/{pk}/", {"name": name}, key=key)
    assert not replayed(send(client, "PUT", f"/drf/groups/{pk}/", {"name": name}, key=key))
    assert CALLS[f"viewset:{name}"] == 2


def test_mixin_composes_with_other_mixins_overriding_the_same_hooks(client) -> None:
    key, script = new_key(), ScriptFactory()
    TRACE.clear()
    send(client, "POST", "/drf/traced/", script, key=key)
    assert TRACE == ["dispatch", "initial", "post", "finalize_response"]
    TRACE.clear()
    retry = send(client, "POST", "/drf/traced/", script, key=key)
    # The replay skips the handler, not the other mixin's hooks.
    assert replayed(retry)
    assert TRACE == ["dispatch", "initial", "finalize_response"]


class ClassLevelPrincipal(IdempotencyMixin, APIView):
    # A plain function as a class attribute comes back bound; the mixin must unwrap it.
    idempotency_principal = tenant_principal
    permission_classes = [AllowAny]

    def post(self, request: Any) -> Response:
        return Response({"execution": CALLS.hit("class-level-principal")}, status=201)


def test_principal_function_set_as_a_class_attribute_is_called_with_the_request() -> None:
    view = ClassLevelPrincipal.as_view()
    key = new_key()
    request = APIRequestFactory().post(
        "/class-level/", {}, format="json", headers={"Idempotency-Key": key, "X-Tenant": "acme"}
    )
    assert view(request).status_code == 201
    assert IdempotencyRecord.objects.get(key=key).scope == "tenant:acme"


def test_overrides_default_to_none_so_settings_are_read_per_request(settings, client) -> None:
    for name in (
        "idempotency_methods", "idempotency_required", "idempotency_ttl", "idempotency_wait",
        "idempotency_exclude_fields", "idempotency_fingerprint_headers", "idempotency_principal",
    ):  # fmt: skip
        assert getattr(IdempotencyMixin, name) is None
    settings.IDEMPOTENCY_REQUIRED = True
    assert send(client, "POST", "/drf/", ScriptFactory()).status_code == 400
    settings.IDEMPOTENCY_REQUIRED = False
    assert send(client, "POST", "/drf/", ScriptFactory()).status_code == 201


class CustomOptions(IdempotencyMixin, APIView):
    permission_classes = [AllowAny]

    def get_idempotency_options(self) -> Any:
        # The hook a subclass overrides to compute options per request.
        self.idempotency_required = self.request.headers.get("X-Strict") == "1"
        return super().get_idempotency_options()

    def post(self, request: Any) -> Response:
        return Response({}, status=201)


def test_get_idempotency_options_hook_can_decide_per_request() -> None:
    view = CustomOptions.as_view()
    factory = APIRequestFactory()
    strict = view(factory.post("/x/", {}, format="json", headers={"X-Strict": "1"}))
    lenient = view(factory.post("/x/", {}, format="json"))
    assert strict.status_code == 400
    assert json.loads(strict.content)["type"].endswith("missing-key")
    assert lenient.status_code == 201


class BodyKeyAuthentication(BaseAuthentication):
    """Reads the request body before the key is claimed, as some API-key schemes do."""

    def authenticate(self, request: Any) -> Any:
        request.data.get("api_key")
        return None


class ReadsBodyFirst(IdempotencyMixin, APIView):
    authentication_classes = [BodyKeyAuthentication]
    permission_classes = [AllowAny]
    idempotency_allow_anonymous = True
    parser_classes = [JSONParser, MultiPartParser]

    def post(self, request: Any) -> Response:
        tag = request.query_params["tag"]
        return Response({"execution": CALLS.hit(tag), "nonce": new_key()}, status=201)


@pytest.mark.parametrize("multipart", [False, True], ids=["json", "multipart"])
def test_body_read_by_an_authenticator_is_still_fingerprinted(multipart: bool) -> None:
    view, factory, key, tag = ReadsBodyFirst.as_view(), APIRequestFactory(), new_key(), new_key()

    def post(amount: str) -> Any:
        request = factory.post(
            f"/reads-body/?tag={tag}", {"api_key": "k", "amount": amount},
            format="multipart" if multipart else "json", headers={"Idempotency-Key": key},
        )  # fmt: skip
        response = view(request)
        # A replay or a problem is a finished HttpResponse; the view's own is a Response.
        return response.render() if hasattr(response, "render") else response

    first = post("1")
    retry = post("1")
    changed = post("2")
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert changed.status_code == 422
    assert json.loads(changed.content)["differing"] == ["body"]
    assert CALLS[tag] == 1


def test_success_for_a_client_accepting_only_problem_json_is_labelled_as_what_it_is(
    client,
) -> None:
    response = send(
        client, "POST", "/drf/", ScriptFactory(), key=new_key(),
        headers={"Accept": "application/problem+json"},
    )  # fmt: skip
    assert response.status_code == 201
    assert response["Content-Type"] == "application/json"


# Holes found under attack (issue 9).


def test_a_body_no_parser_accepts_is_415_unread_unstored_and_the_key_stays_free() -> None:
    key, client = new_key(), APIClient()
    # 3 MB is over DATA_UPLOAD_MAX_MEMORY_SIZE: reading it would answer 400, not 415.
    upload = b"x" * (3 * 1024 * 1024)
    response = client.post(
        "/drf/json-only/",
        {"file": SimpleUploadedFile("big.bin", upload)},
        format="multipart",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert response.status_code == 415
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    ok = send(client, "POST", "/drf/json-only/", ScriptFactory(), key=key)
    assert ok.status_code == 201


def test_authentication_comes_before_the_body_is_read() -> None:
    body = json.dumps({"pad": "x" * (3 * 1024 * 1024)})
    response = send(
        APIClient(), "POST", "/drf/guarded/", body, key=new_key(),
        headers={"Authorization": "Token wrong"},
    )  # fmt: skip
    assert response.status_code == 401


def test_the_negotiated_media_type_is_part_of_the_fingerprint() -> None:
    key, script, client = new_key(), ScriptFactory(), APIClient()
    text = send(
        client, "POST", "/drf/negotiated/", script, key=key, headers={"Accept": "text/plain"}
    )
    assert text["Content-Type"].startswith("text/plain")
    as_json = send(
        client, "POST", "/drf/negotiated/", script, key=key, headers={"Accept": "application/json"}
    )
    assert as_json.status_code == 422
    assert problem(as_json)["differing"] == ["header:accept"]
    again = send(
        client, "POST", "/drf/negotiated/", script, key=key, headers={"Accept": "text/plain"}
    )
    assert replayed(again)
    assert again.content == text.content


@pytest.mark.parametrize("path", ["/drf/negotiated/", "/drf/api-view/negotiated/"])
def test_a_replay_is_never_in_a_media_type_the_retry_did_not_ask_for(path: str) -> None:
    key, script, client = new_key(), ScriptFactory(), APIClient()
    text = send(client, "POST", path, script, key=key, headers={"Accept": "text/plain"})
    assert text.status_code == 201 and text["Content-Type"].startswith("text/plain")
    as_json = send(client, "POST", path, script, key=key, headers={"Accept": "application/json"})
    assert as_json.status_code == 422 and not replayed(as_json)
    assert problem(as_json)["differing"] == ["header:accept"]
    again = send(client, "POST", path, script, key=key, headers={"Accept": "text/plain"})
    assert replayed(again) and again.content == text.content
    assert CALLS[script["tag"]] == 1


def test_a_replay_on_a_detail_route_checks_object_permissions_first() -> None:
    group = Group.objects.create(name="owned")
    key, client = new_key(), APIClient()
    path = f"/drf/groups/{group.pk}/"
    first = send(client, "PATCH", path, {"name": "renamed"}, key=key)
    assert first.status_code == 200
    assert replayed(send(client, "PATCH", path, {"name": "renamed"}, key=key))
    revoked = send(
        client, "PATCH", path, {"name": "renamed"}, key=key, headers={"X-Deny-Object": "yes"}
    )
    assert revoked.status_code in (401, 403)  # anonymous here: DRF says 401
    assert not replayed(revoked)


def test_idempotent_under_api_view_has_the_mixins_guarantees() -> None:
    key, script, client = new_key(), ScriptFactory(), APIClient()
    first = send(client, "POST", "/drf/api-view/", script, key=key)
    assert first.status_code == 201
    assert first["Content-Type"] == "application/json"
    retry = send(client, "POST", "/drf/api-view/", script, key=key)
    assert replayed(retry)
    assert retry.content == first.content
    assert CALLS[script["tag"]] == 1
    invalid_key, invalid = new_key(), ScriptFactory(reject="invalid")
    assert send(client, "POST", "/drf/api-view/", invalid, key=invalid_key).status_code == 400
    assert replayed(send(client, "POST", "/drf/api-view/", invalid, key=invalid_key))
    reused = send(client, "POST", "/drf/api-view/", ScriptFactory(), key=key)
    assert reused.status_code == 422


# The mixin's place in the bases (contract 15): after a DRF view class it would never run.


def drf_bases() -> dict[str, type]:
    from adrf.views import APIView as AsyncAPIView
    from adrf.viewsets import ViewSet as AsyncViewSet
    from rest_framework import generics, viewsets

    return {
        "APIView": APIView,
        "CreateAPIView": generics.CreateAPIView,
        "GenericAPIView": generics.GenericAPIView,
        "ModelViewSet": viewsets.ModelViewSet,
        "GenericViewSet": viewsets.GenericViewSet,
        "adrf APIView": AsyncAPIView,
        "adrf ViewSet": AsyncViewSet,
    }


BASES = ["APIView", "CreateAPIView", "GenericAPIView", "ModelViewSet", "GenericViewSet",
         "adrf APIView", "adrf ViewSet"]  # fmt: skip


@pytest.mark.parametrize("base", BASES)
def test_the_mixin_after_a_drf_view_class_is_refused_when_the_class_is_made(base: str) -> None:
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match=r"after a DRF view class.*Put IdempotencyMix"):
        type("Orders", (drf_bases()[base], IdempotencyMixin), {})


class Audited:
    """Another mixin of the project's, listed before ours."""


@pytest.mark.parametrize("base", BASES)
def test_the_mixin_before_the_drf_view_class_is_accepted_and_so_are_subclasses(base: str) -> None:
    view = type("Orders", (IdempotencyMixin, drf_bases()[base]), {})
    type("MoreOrders", (view,), {})
    type("AuditedOrders", (Audited, IdempotencyMixin, drf_bases()[base]), {})
    type("Subclassed", (Audited, view), {})


def test_a_mixin_after_a_view_class_is_refused_in_a_subclass_too() -> None:
    from django.core.exceptions import ImproperlyConfigured

    class Plain(APIView):
        pass

    with pytest.raises(ImproperlyConfigured):
        type("Late", (Plain, IdempotencyMixin), {})


@pytest.mark.django_db(transaction=True)
def test_over_http_a_keyed_retry_of_a_delete_answers_the_stored_204(
    live_server: Any, make_token_user: Any
) -> None:
    from testproject.payments.models import Charge

    alice, bob = make_token_user(), make_token_user()
    charge = Charge.objects.create(amount=100, currency="eur", user=alice.user)
    url, key = f"{live_server.url}/drf/charges/{charge.pk}/", new_key()

    def delete(user: Any, key: str, path: str = url) -> requests.Response:
        return requests.delete(path, headers={**user.headers, "Idempotency-Key": key}, timeout=30)

    first = delete(alice, key)
    assert first.status_code == 204 and not replayed(first)
    for _ in range(2):
        retry = delete(alice, key)
        assert retry.status_code == 204 and replayed(retry), (retry.status_code, retry.text)
    assert CALLS[f"destroy:{charge.pk}"] == 1
    # Only its principal replays a record: Bob's request with Alice's key runs as his own.
    bobs = delete(bob, key)
    assert bobs.status_code == 404 and not replayed(bobs)
    # An object that exists again is checked before any replay: Bob's charge under the
    # same id is not Alice's to delete, whatever she stored.
    Charge.objects.create(pk=charge.pk, amount=5, currency="eur", user=bob.user)
    refused = delete(alice, key)
    assert refused.status_code == 403 and not replayed(refused)
    assert Charge.objects.filter(pk=charge.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_a_replay_of_a_delete_is_a_404_for_an_object_the_queryset_hides(
    make_token_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from testproject.payments.models import Charge
    from tests.support.payment_views import ChargeViewSet

    alice = make_token_user()
    charge = Charge.objects.create(amount=100, currency="eur", user=alice.user)
    client, key, path = alice.client(), new_key(), f"/drf/charges/{charge.pk}/"
    assert send(client, "DELETE", path, key=key).status_code == 204
    Charge.objects.create(pk=charge.pk, amount=5, currency="eur", user=alice.user)
    # The object exists, but the view no longer shows it to this client: not a replay.
    monkeypatch.setattr(ChargeViewSet, "queryset", Charge.objects.none())
    hidden = send(client, "DELETE", path, key=key)
    assert hidden.status_code == 404 and not replayed(hidden)


def test_the_mixin_declares_one_typed_attribute_per_option_defaulting_to_the_settings() -> None:
    declared = {
        name.removeprefix("idempotency_"): kind
        for name, kind in get_type_hints(IdempotencyMixin).items()
        if name.startswith("idempotency_")
    }
    assert list(declared) == list(OPTION_NAMES)
    assert declared == get_type_hints(ViewOptions)
    assert all(vars(IdempotencyMixin)[f"idempotency_{name}"] is None for name in OPTION_NAMES)


# Refusals in the project's own envelope: DRF's EXCEPTION_HANDLER, or a function.


def envelope_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """A team's EXCEPTION_HANDLER: DRF's default, re-wrapped in its own envelope."""
    response = exception_handler(exc, context)
    if response is not None:
        detail = response.data["detail"]
        response.data = {"error": {"code": detail.code, "message": str(detail)}}
    return response


def envelope(error: Any) -> dict[str, Any]:
    """An IDEMPOTENCY_ERROR_FORMAT function."""
    return {"error": {"code": error.name, "message": error.detail, **error.extra}}


def reused(client: Any, path: str = "/drf/") -> Any:
    key, script = new_key(), ScriptFactory()
    assert send(client, "POST", path, script, key=key).status_code == 201
    return send(client, "POST", path, {**script, "x": 1}, key=key)


@override_settings(
    IDEMPOTENCY_DRF_EXCEPTION_HANDLER=True,
    REST_FRAMEWORK={"EXCEPTION_HANDLER": "tests.test_rest_framework.envelope_handler"},
)
def test_with_the_drf_handler_on_a_refusal_goes_through_exception_handler(client) -> None:
    response = reused(client)
    assert response.status_code == 422
    assert response["Content-Type"] == "application/json"
    assert response["Cache-Control"] == "no-store"
    assert response.json() == {
        "error": {
            "code": "key-reused",
            "message": "This Idempotency-Key was already used for a different request. "
            "Use a new key for a new request.",
        }
    }


@override_settings(IDEMPOTENCY_DRF_EXCEPTION_HANDLER=True)
def test_with_drfs_default_handler_a_refusal_is_drfs_own_detail(client) -> None:
    response = reused(client)
    assert response.status_code == 422
    assert set(response.json()) == {"detail"}
    # The plain decorator has no EXCEPTION_HANDLER: its refusals stay problem+json.
    assert reused(client, "/plain/")["Content-Type"] == "application/problem+json"


@pytest.mark.django_db(transaction=True)
@override_settings(
    IDEMPOTENCY_DRF_EXCEPTION_HANDLER=True,
    REST_FRAMEWORK={"EXCEPTION_HANDLER": "tests.test_rest_framework.envelope_handler"},
)
def test_a_409_through_the_drf_handler_keeps_its_retry_after(client) -> None:
    key = new_key()
    with held_claim("anonymous", key):
        response = send(client, "POST", "/drf/", ScriptFactory(), key=key)
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "in-progress"
    assert int(response["Retry-After"]) >= 1


@pytest.mark.parametrize("path", ["/drf/", "/plain/"])
@pytest.mark.parametrize("setting", ["tests.test_rest_framework.envelope", envelope])
def test_an_error_format_function_shapes_the_body_of_every_view_style(
    client, path: str, setting: Any
) -> None:
    with override_settings(IDEMPOTENCY_ERROR_FORMAT=setting):
        response = reused(client, path)
    assert response.status_code == 422
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "key-reused"
    assert response.json()["error"]["differing"] == ["body"]
