"""The outbox keeps order per key: a message may carry an ordering key, and takes a place in
that key's order (``ordering_seq``) when it is written, under a transaction-level lock on the
key, so that places follow commit order (``messaging/outbox.py``). The relay claims a keyed
message only once every earlier one of its key is published (``messaging/leases.py``).

The places come from a sequence of their own: ``nextval()`` is taken after the key's lock,
and no clock is involved. The index holds only unpublished keyed rows, the claim's lookup.
The enqueuing request's trace context travels in the ``options`` document, so it needs no
column.

Plain Django operations: on PostgreSQL a column or an index added to the partitioned table
reaches every partition, and those created later; null columns are added without rewriting
the table. Frozen: nothing is imported from the package.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

ORDER_SEQUENCE = "django_idempotency_outbox_order"


def create_sequence(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    # Elsewhere (SQLite) the database serialises writers, and a place is max + 1.
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {ORDER_SEQUENCE}", params=None)


def drop_sequence(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {ORDER_SEQUENCE}", params=None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0013_outbox_events")]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="ordering_key",
            field=models.CharField(max_length=255, null=True, verbose_name="ordering key"),
        ),
        migrations.AddField(
            model_name="outboxmessage",
            name="ordering_seq",
            field=models.BigIntegerField(null=True, verbose_name="place in its key's order"),
        ),
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(
                condition=models.Q(("ordering_key__isnull", False), ("published_at__isnull", True)),
                fields=["ordering_key", "ordering_seq"],
                name="idempotency_outbox_order",
            ),
        ),
        migrations.RunPython(create_sequence, drop_sequence, elidable=False),
    ]
