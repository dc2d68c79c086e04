"""A sequence per payment table counting handler runs, rollbacks included (see executions.py)."""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

SEQUENCES = ("payments_charge_executions", "payments_refund_executions")


def create_sequences(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    # Only PostgreSQL has sequences outside tables; elsewhere executions are not counted.
    if schema_editor.connection.vendor == "postgresql":
        for name in SEQUENCES:
            schema_editor.execute(f"CREATE SEQUENCE {schema_editor.quote_name(name)}")


def drop_sequences(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for name in SEQUENCES:
            schema_editor.execute(f"DROP SEQUENCE IF EXISTS {schema_editor.quote_name(name)}")


class Migration(migrations.Migration):
    dependencies = [("payments", "0001_charges_and_refunds")]

    operations = [migrations.RunPython(create_sequences, drop_sequences, elidable=False)]
