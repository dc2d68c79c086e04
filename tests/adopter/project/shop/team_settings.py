"""The team's settings, imported at the end of the generated shop/settings.py."""

import os

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
    "payments",
]

# PGHOST, PGPORT, PGUSER and PGPASSWORD come from the environment, as libpq reads them.
DATABASES = {
    "default": {"ENGINE": "django.db.backends.postgresql", "NAME": os.environ["SHOP_DATABASE"]}
}

ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

# Stored responses sealed at rest; the key comes from the team's secret store.
IDEMPOTENCY_ENCRYPTION_KEYS = [os.environ["SHOP_RESPONSE_KEY"]]
IDEMPOTENCY_PROBE_TOKEN = os.environ.get("SHOP_PROBE_TOKEN")
