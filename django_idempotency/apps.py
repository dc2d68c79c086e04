from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class IdempotencyConfig(AppConfig):
    name = "django_idempotency"
    verbose_name = _("Idempotency")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_idempotency import checks  # noqa: F401  registers the system checks
