"""The test project's Celery app: ``celery -A testproject worker``."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

app = Celery("testproject")
# CELERY_BROKER_URL (env, default memory://) and the other CELERY_* settings.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
