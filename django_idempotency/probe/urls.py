"""``path("idempotency/probe/", include("django_idempotency.probe.urls"))``."""

from __future__ import annotations

from django.urls import path

from django_idempotency.probe import views

app_name = "django_idempotency_probe"
urlpatterns = [
    path("run/", views.run, name="run"),
    path("report/", views.report, name="report"),
]
