"""Each running relay keeps a heartbeat row (owner, host, pid, when it started and last
beat, what it published), for operators, ``manage.py idempotency_outbox status`` and the
telemetry gauge. A small plain table: one row per relay, never partitioned.
Frozen: nothing is imported from the package.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0014_outbox_order_and_trace")]

    operations = [
        migrations.CreateModel(
            name="RelayHeartbeat",
            fields=[
                (
                    "owner",
                    models.CharField(
                        max_length=64, primary_key=True, serialize=False, verbose_name="relay"
                    ),
                ),
                ("host", models.CharField(max_length=255, verbose_name="host")),
                ("pid", models.IntegerField(verbose_name="process id")),
                ("started_at", models.DateTimeField(verbose_name="started at")),
                ("beat_at", models.DateTimeField(db_index=True, verbose_name="last beat at")),
                (
                    "published",
                    models.BigIntegerField(default=0, verbose_name="messages published"),
                ),
                ("failed", models.BigIntegerField(default=0, verbose_name="failed publishes")),
                (
                    "last_error",
                    models.TextField(blank=True, default="", verbose_name="last error"),
                ),
            ],
            options={
                "verbose_name": "relay heartbeat",
                "verbose_name_plural": "relay heartbeats",
                "db_table": "django_idempotency_relay_heartbeat",
            },
        ),
    ]
