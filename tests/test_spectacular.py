"""drf-spectacular documents the key header and our error responses on every idempotent
operation, with no code in the project."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import Group
from django.test import override_settings
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.utils import extend_schema
from drf_spectacular.validation import validate_schema
from rest_framework import generics, serializers

import django_idempotency.contrib.spectacular  # noqa: F401  what AppConfig.ready() imports
from django_idempotency.rest_framework import IdempotencyMixin
from tests.conftest import unmeasured
from tests.support import urls as test_urls

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = "application/problem+json"
SPECTACULAR = {"DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}


class GroupSerializer(serializers.ModelSerializer[Group]):
    class Meta:
        model = Group
        fields = ["id", "name"]


class ValidationErrorSerializer(serializers.Serializer[dict[str, list[str]]]):
    name = serializers.ListField(child=serializers.CharField())


def own_urlpatterns() -> list:
    """Views of our own, made under drf-spectacular's schema class: @extend_schema bases
    its schema on DEFAULT_SCHEMA_CLASS as it is when the view is defined."""

    class GroupList(IdempotencyMixin, generics.ListCreateAPIView[Group]):
        """Groups, created idempotently."""

        queryset = Group.objects.all()
        serializer_class = GroupSerializer

        @extend_schema(responses={201: GroupSerializer, 400: ValidationErrorSerializer})
        def post(self, request, *args, **kwargs):
            return super().post(request, *args, **kwargs)

    class Excluded(IdempotencyMixin, generics.CreateAPIView[Group]):
        queryset = Group.objects.all()
        serializer_class = GroupSerializer
        schema = None

    return [path("groups/", GroupList.as_view()), path("excluded/", Excluded.as_view())]


def schema_for(patterns) -> dict:
    with override_settings(REST_FRAMEWORK=SPECTACULAR):
        if callable(patterns):
            patterns = patterns()
        schema = SchemaGenerator(patterns=patterns).get_schema(request=None, public=True)
    validate_schema(schema)
    return schema


def parameter(operation: dict, name: str) -> dict | None:
    found = [p for p in operation.get("parameters", ()) if p["name"] == name]
    return found[0] if found else None


def problem_codes(operation: dict) -> set[str]:
    return {
        code
        for code, response in operation["responses"].items()
        if PROBLEM in response.get("content", {})
    }


@pytest.fixture(scope="module")
def scripted() -> dict:
    return schema_for(test_urls.urlpatterns)["paths"]


def test_covered_methods_document_the_key_header_and_the_problem_responses(scripted):
    for method in ("post", "patch"):
        operation = scripted["/drf/"][method]
        header = parameter(operation, "Idempotency-Key")
        assert header is not None
        assert (header["in"], header.get("required", False)) == ("header", False)
        assert problem_codes(operation) == {"400", "409", "422", "503"}
        responses = operation["responses"]
        retried = {c for c, r in responses.items() if "Retry-After" in r.get("headers", {})}
        assert retried == {"409", "503"}


def test_other_methods_are_left_alone(scripted):
    for method in ("get", "put", "delete"):
        operation = scripted["/drf/"][method]
        assert parameter(operation, "Idempotency-Key") is None
        assert problem_codes(operation) == set()


def test_the_problem_renderer_is_no_media_type_of_the_views_own_responses(scripted):
    operation = scripted["/drf/"]["post"]
    own = [r for c, r in operation["responses"].items() if c not in problem_codes(operation)]
    assert own
    for response in own:
        assert PROBLEM not in response.get("content", {})
        assert "Idempotent-Replayed" in response["headers"]
    for code in problem_codes(operation):
        assert "Idempotent-Replayed" not in operation["responses"][code].get("headers", {})


def test_a_required_key_is_a_required_header_and_may_be_missing(scripted):
    operation = scripted["/drf/required/"]["post"]

    assert parameter(operation, "Idempotency-Key")["required"] is True
    assert "missing-key" in operation["responses"]["400"]["description"]
    assert "missing-key" not in scripted["/drf/"]["post"]["responses"]["400"]["description"]


def test_per_view_methods_decide_which_operations_are_covered(scripted):
    put_only = scripted["/drf/put-only/"]
    assert parameter(put_only["put"], "Idempotency-Key") is not None
    assert parameter(put_only["post"], "Idempotency-Key") is None
    # A viewset: create on the list route, partial_update on the detail route.
    assert parameter(scripted["/drf/groups/"]["post"], "Idempotency-Key") is not None
    detail = scripted["/drf/groups/{id}/"]
    assert parameter(detail["patch"], "Idempotency-Key") is not None
    assert parameter(detail["put"], "Idempotency-Key") is None
    assert "201" in scripted["/drf/groups/"]["post"]["responses"]


def test_the_views_own_responses_and_docs_are_kept():
    schema = schema_for(own_urlpatterns)
    operation = schema["paths"]["/groups/"]["post"]

    assert operation["description"] == "Groups, created idempotently."
    assert operation["responses"]["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Group"
    }
    validation = operation["responses"]["400"]["content"]
    assert validation["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ValidationError"
    }
    assert validation[PROBLEM]["schema"] == {"$ref": "#/components/schemas/IdempotencyProblem"}
    assert set(schema["components"]["schemas"]["IdempotencyProblem"]["properties"]) == {
        "type",
        "title",
        "status",
        "detail",
        "differing",
    }
    assert "/excluded/" not in schema["paths"]


@override_settings(IDEMPOTENCY_EXPIRED_WINDOW=timedelta(hours=1))
def test_an_expired_window_adds_the_gone_response():
    operation = schema_for(test_urls.urlpatterns)["paths"]["/drf/"]["post"]

    assert "410" in problem_codes(operation)
    assert "key-expired" in operation["responses"]["410"]["description"]


@override_settings(IDEMPOTENCY_HEADER="X-Request-Key")
def test_the_header_name_follows_the_setting():
    operation = schema_for(test_urls.urlpatterns)["paths"]["/drf/"]["post"]

    assert parameter(operation, "X-Request-Key") is not None
    assert parameter(operation, "Idempotency-Key") is None


@override_settings(IDEMPOTENCY_ERROR_FORMAT="stripe")
def test_the_stripe_preset_documents_stripe_errors_without_hiding_the_views_own():
    schema = schema_for(own_urlpatterns)
    responses = schema["paths"]["/groups/"]["post"]["responses"]

    assert not any(PROBLEM in r.get("content", {}) for r in responses.values())
    assert responses["409"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/IdempotencyStripeError"
    }
    # 400 is the view's own validation error; Stripe's idempotency 400 shares its type.
    assert responses["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ValidationError"
    }
    assert "422" not in responses


@pytest.mark.parametrize(
    "overrides",
    [
        {"IDEMPOTENCY_ERROR_FORMAT": "tests.test_rest_framework.envelope"},
        {"IDEMPOTENCY_DRF_EXCEPTION_HANDLER": True},
    ],
)
def test_errors_in_the_projects_own_envelope_are_documented_by_status_without_a_shape(
    overrides: dict,
) -> None:
    with override_settings(**overrides):
        schema = schema_for(own_urlpatterns)
    validate_schema(schema)
    responses = schema["paths"]["/groups/"]["post"]["responses"]
    assert not any(PROBLEM in r.get("content", {}) for r in responses.values())
    assert responses["409"]["content"]["application/json"]["schema"]["type"] == "object"
    assert "in-progress" in responses["409"]["description"]
    # The view's own 400 keeps its schema.
    assert responses["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ValidationError"
    }


def spectacular(*args: str) -> subprocess.CompletedProcess[str]:
    """``manage.py spectacular *args`` under the test settings. Not traced by coverage.py:
    the schema's generation runs in this process too."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "manage.py", "spectacular", *args],
        cwd=ROOT,
        env=unmeasured(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_testproject_schema_validates_and_documents_its_idempotent_endpoints(tmp_path):
    # The project's own settings, which add drf-spectacular as a user does: nothing of
    # ours is imported by hand, so this proves the AppConfig wiring too.
    out = tmp_path / "schema.json"
    done = spectacular("--validate", "--format", "openapi-json", "--file", str(out))
    assert done.returncode == 0, done.stderr
    paths = json.loads(out.read_text())["paths"]

    for endpoint in ("/api/charges/", "/api/refunds/"):
        operation = paths[endpoint]["post"]
        assert parameter(operation, "Idempotency-Key") is not None
        assert problem_codes(operation) >= {"400", "409", "422"}
    assert parameter(paths["/api/charges-plain/"]["post"], "Idempotency-Key") is None


def test_the_testproject_schema_generates_without_a_warning_or_error(tmp_path):
    # drf-spectacular prints what it cannot describe ("unable to guess serializer") and,
    # with --fail-on-warn, exits non-zero for it.
    done = spectacular("--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))

    assert done.returncode == 0, done.stderr
    assert "unable to guess serializer" not in done.stderr
    assert "Warnings:" not in done.stderr and "Error" not in done.stderr
