from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("payments", "0002_execution_counter_sequences")]

    operations = [
        migrations.CreateModel(
            name="FaultTag",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("tag", models.CharField(max_length=255, unique=True)),
                ("seen_at", models.DateTimeField()),
            ],
        ),
    ]
