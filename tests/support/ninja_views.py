"""Test-only Django Ninja operations (``tests.support.urls``): open to anonymous clients or not,
with anonymous keys meant or not."""

from __future__ import annotations

from django.http import HttpRequest
from ninja import NinjaAPI
from ninja.security import django_auth

from django_idempotency.ninja import idempotent_operation
from tests.support.views import CALLS

api = NinjaAPI(urls_namespace="tests-ninja", docs_url=None)


@api.post("/open/")
@idempotent_operation
def open_operation(request: HttpRequest, tag: str = "") -> dict[str, int]:
    """No auth: every client is the anonymous principal."""
    return {"execution": CALLS.hit(tag)}


@api.post("/anonymous-keys/")
@idempotent_operation(allow_anonymous=True)
def anonymous_keys(request: HttpRequest, tag: str = "") -> dict[str, int]:
    return {"execution": CALLS.hit(tag)}


@api.post("/session/", auth=django_auth)
@idempotent_operation
def session_operation(request: HttpRequest, tag: str = "") -> dict[str, int]:
    return {"execution": CALLS.hit(tag)}
