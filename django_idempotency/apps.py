from __future__ import annotations

from django.apps import AppConfig, apps
from django.utils.translation import gettext_lazy as _


class IdempotencyConfig(AppConfig):
    name = "django_idempotency"
    verbose_name = _("Idempotency")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_idempotency import beat, checks, telemetry  # noqa: F401  checks self-register
        from django_idempotency.http import options

        beat.connect_signals()
        options.connect_signals()
        telemetry.connect()
        if apps.is_installed("drf_spectacular"):
            # Importing the extension is how drf-spectacular learns about it.
            import django_idempotency.contrib.spectacular  # noqa: F401
