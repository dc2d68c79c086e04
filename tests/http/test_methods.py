"""A keyed request with a method the view does not have is answered 405 before any claim: no
record, and the key stays free for the request the client meant (a PATCH to a POST-only view
once stored its 405 and then answered the real POST with 422)."""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.http import require_http_methods, require_POST

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from testproject.payments.models import Charge
from tests.factories import new_key
from tests.support.client import replayed, send

pytestmark = pytest.mark.django_db

CHARGE = {"amount": 2499, "currency": "inr"}
RUNS: list[str] = []


# Anonymous on purpose: the tests are about methods, not principals.
ANONYMOUS_OK = idempotent(allow_anonymous=True)


@ANONYMOUS_OK
@require_POST
def post_only(request: HttpRequest) -> JsonResponse:
    RUNS.append(request.method or "")
    return JsonResponse({"run": len(RUNS)}, status=201)


@idempotent(methods=["POST", "PUT", "PATCH"], allow_anonymous=True)
@require_http_methods(["GET", "POST", "PUT"])
def no_patch(request: HttpRequest) -> JsonResponse:
    RUNS.append(request.method or "")
    return JsonResponse({"run": len(RUNS)}, status=201)


class PostOnly(View):
    http_method_names = ["get", "post", "patch"]  # no patch() handler: still 405

    def post(self, request: HttpRequest) -> JsonResponse:
        RUNS.append(request.method or "")
        return JsonResponse({"run": len(RUNS)}, status=201)

    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse()


@method_decorator(ANONYMOUS_OK, name="dispatch")
class DispatchDecorated(PostOnly):
    pass


urlpatterns = [
    path("post-only/", post_only),
    path("no-patch/", no_patch),
    path("class/", ANONYMOUS_OK(PostOnly.as_view())),
    path("dispatch/", DispatchDecorated.as_view()),
]


def test_a_patch_to_the_post_only_charges_view_is_405_and_leaves_the_key_free(
    api_client: Any,
) -> None:
    key = new_key()

    wrong = api_client.patch("/api/charges/", CHARGE, format="json", HTTP_IDEMPOTENCY_KEY=key)
    again = api_client.patch("/api/charges/", CHARGE, format="json", HTTP_IDEMPOTENCY_KEY=key)
    meant = api_client.post("/api/charges/", CHARGE, format="json", HTTP_IDEMPOTENCY_KEY=key)

    assert wrong.status_code == 405 and again.status_code == 405 and not replayed(again)
    assert meant.status_code == 201 and not replayed(meant)
    assert Charge.objects.filter(pk=meant.json()["id"]).exists()
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@pytest.mark.urls(__name__)
@pytest.mark.parametrize(
    ("route", "method"),
    [
        ("/post-only/", "PATCH"),  # require_POST
        ("/no-patch/", "PATCH"),  # require_http_methods
        ("/no-patch/", "DELETE"),  # a method the view's policy does not cover: untouched
        ("/class/", "PATCH"),  # http_method_names lists it, but the class has no handler
        ("/class/", "PUT"),  # not in http_method_names
        ("/dispatch/", "PATCH"),  # method_decorator on dispatch()
    ],
)
def test_a_plain_view_answers_a_method_it_lacks_with_405_before_any_claim(
    client: Any, route: str, method: str
) -> None:
    RUNS.clear()
    key = new_key()

    wrong = send(client, method, route, CHARGE, key=key, headers={})
    meant = send(client, "POST", route, CHARGE, key=key)
    replay = send(client, "POST", route, CHARGE, key=key)

    assert wrong.status_code == 405
    assert meant.status_code == 201 and not replayed(meant)
    assert replayed(replay) and RUNS == ["POST"]
    assert IdempotencyRecord.objects.filter(key=key).count() == 1
