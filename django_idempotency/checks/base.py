"""What every check shares: whether a run concerns this app, and a setting as the user
wrote it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings


def ours(app_configs: Sequence[AppConfig] | None) -> bool:
    return app_configs is None or apps.get_app_config("django_idempotency") in app_configs


def as_written(name: str) -> Any:
    # conf normalises some values (upper-cased methods, int()); a check must see them as
    # the user wrote them.
    return getattr(settings, f"IDEMPOTENCY_{name}", None)
