"""Database routers as projects write them, for the deployment-shape tests.

- ``ReplicaRouter``: every read to the ``replica`` alias, every write to ``default``.
- ``TenantRouter`` with ``TenantMiddleware``: the ``X-Tenant`` header picks the database of the
  request's tenant (``a``: ``default``, ``b``: ``shard``) for the models of the apps in
  ``settings.TENANT_APPS``; everything else (users, tokens) is left to the next router.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from django.conf import settings
from django.db.models import Model
from django.http import HttpRequest, HttpResponseBase

TENANT_DATABASES = {"a": "default", "b": "shard"}

current_tenant: ContextVar[str | None] = ContextVar("current_tenant", default=None)


class ReplicaRouter:
    """Reads from the replica, writes to the primary."""

    def db_for_read(self, model: type[Model], **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: type[Model], **hints: Any) -> str:
        return "default"

    def allow_relation(self, obj1: Model, obj2: Model, **hints: Any) -> bool:
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        # The replica gets its schema by replication.
        return False if db == "replica" else None


class TenantRouter:
    """The tenant's database for the tenant's models; no opinion on the others."""

    def _tenant_database(self, model: type[Model]) -> str | None:
        tenant = current_tenant.get()
        if tenant is None or model._meta.app_label not in getattr(settings, "TENANT_APPS", ()):
            return None
        return TENANT_DATABASES[tenant]

    def db_for_read(self, model: type[Model], **hints: Any) -> str | None:
        return self._tenant_database(model)

    def db_for_write(self, model: type[Model], **hints: Any) -> str | None:
        return self._tenant_database(model)

    def allow_relation(self, obj1: Model, obj2: Model, **hints: Any) -> bool:
        # A tenant's charge points at a user in default (PostgreSQL checks the foreign key
        # in the tenant's database, where the user is copied).
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return None


def TenantMiddleware(
    get_response: Callable[[HttpRequest], HttpResponseBase],
) -> Callable[[HttpRequest], HttpResponseBase]:
    """Set the tenant from ``X-Tenant`` (``a`` or ``b``; none: no tenant) for the request."""

    def middleware(request: HttpRequest) -> HttpResponseBase:
        tenant = request.headers.get("X-Tenant")
        token = current_tenant.set(tenant if tenant in TENANT_DATABASES else None)
        try:
            return get_response(request)
        finally:
            current_tenant.reset(token)

    return middleware
