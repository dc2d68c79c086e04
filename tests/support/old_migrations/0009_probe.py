"""The deployment probe's table: one row per execution of a probe key (``probe/``).

Frozen: nothing is imported from the package. The table goes where the records go (the
routers are asked about the app's models), on any database.
"""

from __future__ import annotations

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0008_shared_secret"),
    ]

    operations = [
        migrations.CreateModel(
            name="ProbeRow",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key", models.CharField(db_index=True, max_length=255, verbose_name="key")),
                ("server", models.CharField(max_length=255, verbose_name="app server")),
                (
                    "created_at",
                    models.DateTimeField(
                        db_index=True, default=django.utils.timezone.now, verbose_name="created at"
                    ),
                ),
            ],
            options={
                "verbose_name": "probe write",
                "verbose_name_plural": "probe writes",
                "db_table": "django_idempotency_probe",
            },
        ),
    ]
