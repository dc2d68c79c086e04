from __future__ import annotations

from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "testproject.payments"
    label = "payments"
    verbose_name = "Payments (demo)"
    default_auto_field = "django.db.models.BigAutoField"
