from __future__ import annotations

from typing import Any

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def payment_fields() -> list[tuple[str, models.Field[Any, Any]]]:
    return [
        (
            "id",
            models.BigAutoField(
                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
            ),
        ),
        ("amount", models.PositiveIntegerField()),
        ("currency", models.CharField(max_length=3)),
        ("created", models.DateTimeField(auto_now_add=True)),
        (
            "user",
            models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
    ]


class Migration(migrations.Migration):
    initial = True

    dependencies = [migrations.swappable_dependency(settings.AUTH_USER_MODEL)]

    operations = [
        migrations.CreateModel(name="Charge", fields=payment_fields(), options={"abstract": False}),
        migrations.CreateModel(name="Refund", fields=payment_fields(), options={"abstract": False}),
    ]
