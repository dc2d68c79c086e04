"""The permission to read stored responses in the admin (``view_stored_response``): model
options only, no SQL. Frozen: nothing is imported from the package."""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0010_response_version_and_tombstones"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="idempotencyrecord",
            options={
                "permissions": [("view_stored_response", "Can view stored response")],
                "verbose_name": "idempotency record",
                "verbose_name_plural": "idempotency records",
            },
        ),
    ]
