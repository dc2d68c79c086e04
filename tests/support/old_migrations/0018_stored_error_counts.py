"""The bound on stored 4xx per principal and minute (IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE)
is counted in the records' database, one row per principal and minute, so that it holds across
every server process (it was per process: 2 processes stored 158 of 200 where the bound was
100). A small plain table, never partitioned; rows of past minutes are deleted by the app.
Frozen: nothing is imported from the package.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0017_keyed_digests")]

    operations = [
        migrations.CreateModel(
            name="StoredErrorCount",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("scope", models.CharField(max_length=255, verbose_name="principal")),
                ("minute", models.BigIntegerField(verbose_name="minute")),
                ("stored", models.IntegerField(default=0, verbose_name="4xx stored")),
            ],
            options={
                "verbose_name": "stored 4xx count",
                "verbose_name_plural": "stored 4xx counts",
                "db_table": "django_idempotency_error_count",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("scope", "minute"), name="idempotency_error_count"
                    )
                ],
            },
        ),
    ]
