"""Settings of the test project: a small payments API that uses django-idempotency as a user would.

Environment: ``DATABASE_URL`` (else an embedded PostgreSQL, see ``testproject.database``),
``CELERY_BROKER_URL`` (default ``memory://``), ``DJANGO_DEBUG=1``, ``DJANGO_SECRET_KEY``,
``DJANGO_ALLOWED_HOSTS`` (comma-separated) and ``PAYMENTS_FAULTS_ENABLED=1``.

Under ASGI (``testproject.asgi``) connections come from a pool of ``DATABASE_POOL_SIZE``
(default 10) per process instead of staying open per request thread.

Deployment shapes (docs/deployment-shapes.md): ``DATABASE_POOLING=transaction`` when
``DATABASE_URL`` goes through PgBouncer in transaction pooling mode; ``REPLICA_DATABASE_URL``
adds a read replica; ``SHARD_DATABASE_URL`` a second database for tenant ``b``, with
``TENANT_APPS`` (comma-separated app labels, default ``payments``) naming what follows the tenant.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import dj_database_url

from testproject.database import database_url

BASE_DIR = Path(__file__).resolve().parent.parent

# Demo-only fallback; a deployment sets DJANGO_SECRET_KEY.
SECRET_KEY = os.environ.get(
    "DJANGO_SECRET_KEY", "django-insecure-testproject-demo-only-never-use-in-production"
)
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_idempotency",
    "testproject.payments",
]
# Celery (the celery extra) and django-celery-beat (the beat extra: 2.9 does not allow
# Django 6.1) are optional, so the project runs with or without them.
if importlib.util.find_spec("django_celery_beat") is not None:
    INSTALLED_APPS.append("django_celery_beat")
# drf-spectacular (the spectacular extra) documents the Idempotency-Key header by itself.
SPECTACULAR = importlib.util.find_spec("drf_spectacular") is not None
if SPECTACULAR:
    INSTALLED_APPS.append("drf_spectacular")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves the admin's CSS and JS under gunicorn, which serves no files itself.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database(url: str) -> dict[str, Any]:
    # Persistent connections under WSGI: a gunicorn sync worker serves one request at a
    # time, so one connection per worker, reused, with a health check after a server restart.
    config: dict[str, Any] = dj_database_url.parse(url, conn_max_age=600, conn_health_checks=True)
    if SERVED_BY_ASGI:
        # Under ASGI each request runs its sync code in a thread of its own, so a persistent
        # connection would stay open per request: a bounded pool per process instead.
        config["CONN_MAX_AGE"] = 0
        if DATABASE_POOLING != "transaction":
            config["OPTIONS"] = {
                **config.get("OPTIONS", {}),
                "pool": {"min_size": 1, "max_size": DATABASE_POOL_SIZE, "timeout": 10},
            }
    if DATABASE_POOLING == "transaction":
        # Behind PgBouncer in transaction pooling mode, consecutive transactions of one
        # connection may run on different server connections: nothing may outlive a
        # transaction, neither a server-side cursor nor a prepared statement.
        config["DISABLE_SERVER_SIDE_CURSORS"] = True
        config["OPTIONS"] = {**config.get("OPTIONS", {}), "prepare_threshold": None}
    return config


# testproject.asgi sets DJANGO_ASGI=1 before the settings load: served by uvicorn.
SERVED_BY_ASGI = os.environ.get("DJANGO_ASGI") == "1"
if SERVED_BY_ASGI:
    # Also what tells django_idempotency's checks that the project runs under ASGI.
    ASGI_APPLICATION = "testproject.asgi.application"
# Connections per process under ASGI (psycopg's pool).
DATABASE_POOL_SIZE = int(os.environ.get("DATABASE_POOL_SIZE", "10"))


# "transaction" when DATABASE_URL points at PgBouncer with pool_mode = transaction.
DATABASE_POOLING = os.environ.get("DATABASE_POOLING", "session")
DATABASES = {"default": _database(database_url())}
DATABASE_ROUTERS: list[str] = []
# A streaming replica of default: reads go there, writes to default (testproject.routers).
if os.environ.get("REPLICA_DATABASE_URL"):
    DATABASES["replica"] = _database(os.environ["REPLICA_DATABASE_URL"])
    DATABASES["replica"]["TEST"] = {"MIRROR": "default"}
    DATABASE_ROUTERS.append("testproject.routers.ReplicaRouter")
# A second database for tenant "b" (header X-Tenant: b); tenant "a" stays in default. Only the
# models of the apps in TENANT_APPS follow the tenant; others (users, tokens) stay in default.
if os.environ.get("SHARD_DATABASE_URL"):
    DATABASES["shard"] = _database(os.environ["SHARD_DATABASE_URL"])
    DATABASE_ROUTERS.insert(0, "testproject.routers.TenantRouter")
    MIDDLEWARE.insert(0, "testproject.routers.TenantMiddleware")
TENANT_APPS = os.environ.get("TENANT_APPS", "payments").split(",")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
# Partitions are UTC days; aware datetimes everywhere keep created_at unambiguous.
USE_TZ = True

STATIC_URL = "static/"
# The demo serves the apps' static files straight from their directories, so no
# collectstatic step is needed; a deployment sets STATIC_ROOT and runs collectstatic.
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}
if SPECTACULAR:
    REST_FRAMEWORK["DEFAULT_SCHEMA_CLASS"] = "testproject.payments.schema.PaymentsSchema"

# The payments app's fault switches (fail, fail_once, crash_once, delay_ms in a charge
# body). Off unless asked for: the demo and the test settings turn them on.
PAYMENTS_FAULTS_ENABLED = os.environ.get("PAYMENTS_FAULTS_ENABLED") == "1"

# The fake card processor (testproject/processor.py): when set, a charge is captured there
# with a downstream key and posted to the ledger through the outbox.
PAYMENTS_PROCESSOR_URL = os.environ.get("PAYMENTS_PROCESSOR_URL", "")
# Shared with the processor: POST /api/webhooks/processor/ checks its Standard Webhooks
# signatures with it ("whsec_" and base64, as Standard Webhooks senders show theirs).
PAYMENTS_WEBHOOK_SECRET = os.environ.get(
    "PAYMENTS_WEBHOOK_SECRET", "whsec_ZGVtby1vbmx5LXdlYmhvb2stc2VjcmV0"
)
# What posts a charge to the ledger: "celery" (the task payments.post_ledger_entry, which
# IDEMPOTENCY_OUTBOX_ROUTES may send to NATS) or "tasks" (Django's Tasks framework through the
# outbox backend: testproject/payments/ledger_tasks.py; the reliability suite's tasks-rq).
PAYMENTS_LEDGER = "celery"

# The deployment probe's token (/idempotency/probe/); without it the probe cannot run.
IDEMPOTENCY_PROBE_TOKEN = os.environ.get("IDEMPOTENCY_PROBE_TOKEN") or None
# Unset, every server keys its locks with the database's shared secret (as it should); the
# probe's tests set it per server to show the probe failing on two secrets.
IDEMPOTENCY_SECRET_KEY = os.environ.get("IDEMPOTENCY_SECRET_KEY") or None
# The version of the responses of views that declare none (the refunds view); the version
# tests run servers on several at once, as a rolling deploy does.
IDEMPOTENCY_RESPONSE_VERSION = os.environ.get("IDEMPOTENCY_RESPONSE_VERSION") or None

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "memory://")
if CELERY_BROKER_URL.startswith("filesystem://"):
    # kombu's broker in a directory, shared by processes on one machine: the demo's fallback
    # where no Redis is installed.
    _folder = os.environ.get("CELERY_BROKER_FOLDER", str(BASE_DIR / ".broker"))
    # The control folder too: kombu's default is "control" in the working directory.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": _folder,
        "data_folder_out": _folder,
        "control_folder": os.path.join(_folder, "control"),
    }
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"
CELERY_TASK_IGNORE_RESULT = True
if "django_celery_beat" in INSTALLED_APPS:
    CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
elif importlib.util.find_spec("celery") is not None:
    # Without django-celery-beat (Django 6.1): Celery's own schedule, as docs/partitions.md shows.
    from celery.schedules import crontab

    CELERY_BEAT_SCHEDULE = {
        "django-idempotency-partitions": {
            "task": "django_idempotency.maintain_partitions",
            "schedule": crontab(minute=17),
        },
    }

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_idempotency": {
            "handlers": ["console"],
            "level": os.environ.get("IDEMPOTENCY_LOG_LEVEL", "INFO"),
        },
    },
}
