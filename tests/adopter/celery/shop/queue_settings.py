"""Celery: the outbox's default destination, its workers, and beat for the partitions."""

import os

from celery.schedules import crontab

CELERY_BROKER_URL = os.environ["SHOP_REDIS_URL"]

# Hourly as the docs say; SHOP_MAINTENANCE_EVERY (seconds) lets the team's CI see it run.
CELERY_BEAT_SCHEDULE = {
    "django-idempotency-partitions": {
        "task": "django_idempotency.maintain_partitions",
        "schedule": float(os.environ["SHOP_MAINTENANCE_EVERY"])
        if "SHOP_MAINTENANCE_EVERY" in os.environ
        else crontab(minute=17),
    },
}
