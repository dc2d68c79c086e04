"""The URLconf's idempotent views, whatever their style, and the model a view writes."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.http import HttpRequest, HttpResponse
from django.urls import path, re_path
from django.utils.decorators import method_decorator
from django.views import View
from ninja import NinjaAPI
from rest_framework import serializers, viewsets
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.http.endpoints import Endpoint, idempotent_endpoints, written_model
from django_idempotency.ninja import idempotent_operation
from django_idempotency.rest_framework import IdempotencyMixin

pytestmark = pytest.mark.urls(__name__)


class MixinView(IdempotencyMixin, APIView):
    def post(self, request: Request) -> Response:
        return Response(status=201)

    def get(self, request: Request) -> Response:
        return Response()


class GroupSerializer(serializers.ModelSerializer[Group]):
    class Meta:
        model = Group
        fields = ["name"]


class GroupViewSet(IdempotencyMixin, viewsets.ModelViewSet[Group]):
    queryset = Group.objects.all()
    serializer_class = GroupSerializer


@idempotent
def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse(status=201)


@idempotent(methods=["PUT"])
def put_only(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse()


@api_view(["POST"])
@idempotent
def api_function(request: Request) -> Response:
    return Response(status=201)


@method_decorator(idempotent, name="post")
class DecoratedMethodView(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(status=201)

    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse()


def unprotected(request: HttpRequest) -> HttpResponse:
    return HttpResponse()


api = NinjaAPI(urls_namespace="tests-http-endpoints", docs_url=None)


@api.post("/operation/")
@idempotent_operation
def operation(request: HttpRequest) -> dict[str, int]:
    return {"ok": 1}


@api.get("/read/")
def read(request: HttpRequest) -> dict[str, int]:
    return {"ok": 1}


router = SimpleRouter()
router.register("groups", GroupViewSet)

urlpatterns = [
    path("mixin/", MixinView.as_view()),
    path("mixin/", plain),  # the same route again: Django resolves the first
    path("plain/", plain),
    path("things/<int:pk>/", put_only),
    re_path(r"^legacy/(?P<slug>[a-z]+)/$", plain),
    path("api-function/", api_function),
    path("method-decorated/", DecoratedMethodView.as_view()),
    path("unprotected/", unprotected),
    path("ninja/", api.urls),
    *router.urls,
]


def by_route() -> dict[str, list[Endpoint]]:
    found: dict[str, list[Endpoint]] = {}
    for endpoint in idempotent_endpoints():
        found.setdefault(endpoint.route, []).append(endpoint)
    return found


def only(route: str) -> Endpoint:
    (endpoint,) = by_route()[route]
    return endpoint


def test_each_view_style_is_found_and_unprotected_views_are_not() -> None:
    assert set(by_route()) == {
        "/mixin/",
        "/plain/",
        "/things/<int:pk>/",
        "/legacy/<slug>/",
        "/api-function/",
        "/method-decorated/",
        "/ninja/operation/",
        "/groups/",
        "/groups/<pk>/",
    }


def test_a_mixin_view_protects_its_handled_methods_and_names_its_class() -> None:
    endpoint = only("/mixin/")
    assert endpoint.methods == frozenset({"POST"})  # PATCH is covered, but not handled
    assert endpoint.handler is MixinView and isinstance(endpoint.view, MixinView)


def test_a_viewsets_routes_protect_what_their_actions_serve() -> None:
    assert only("/groups/").methods == frozenset({"POST"})
    assert only("/groups/<pk>/").methods == frozenset({"PATCH"})
    assert only("/groups/").handler is GroupViewSet


def test_decorated_functions_carry_their_own_options() -> None:
    assert only("/plain/").methods == frozenset({"POST", "PATCH"})
    assert only("/plain/").handler is plain
    assert only("/things/<int:pk>/").methods == frozenset({"PUT"})
    assert only("/things/<int:pk>/").policy.methods == frozenset({"PUT"})


def test_api_view_and_method_decorator_name_the_decorated_function() -> None:
    api_endpoint = only("/api-function/")
    assert api_endpoint.methods == frozenset({"POST"})
    assert api_endpoint.handler.__name__ == "api_function"
    decorated = only("/method-decorated/")
    assert decorated.methods == frozenset({"POST"})
    assert decorated.handler.__qualname__ == "DecoratedMethodView.post"


def test_a_ninja_operation_is_found_with_its_function() -> None:
    endpoint = only("/ninja/operation/")
    assert endpoint.methods == frozenset({"POST"}) and endpoint.handler is operation


def test_the_regex_matches_stored_paths_without_python_named_groups() -> None:
    regex = only("/things/<int:pk>/").regex
    assert "(?P<" not in regex and "(?P<" not in only("/legacy/<slug>/").regex
    assert re.search(regex, "/things/42/") and not re.search(regex, "/things/x/")
    assert re.search(only("/legacy/<slug>/").regex, "/legacy/abc/")


@pytest.mark.parametrize(
    ("view", "model"),
    [
        (GroupViewSet(), Group),
        (type("BySerializer", (), {"serializer_class": GroupSerializer})(), Group),
        (type("ByQueryset", (), {"queryset": User.objects.all()})(), User),
        (MixinView(), None),
        (plain, None),
    ],
)
def test_written_model_is_the_querysets_else_the_serializers(view: Any, model: Any) -> None:
    assert written_model(view) is model
