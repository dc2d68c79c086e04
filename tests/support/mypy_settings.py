"""Settings for mypy's django-stubs plugin: the apps whose models the package uses, and no
database, so type checking never starts or reaches a PostgreSQL server."""

from __future__ import annotations

SECRET_KEY = "mypy-only"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "rest_framework",
    "drf_spectacular",
    "django_celery_beat",
    "django_idempotency",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
