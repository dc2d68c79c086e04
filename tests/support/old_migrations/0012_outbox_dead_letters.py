"""The outbox keeps dead letters: a message that failed to publish too often stops being
tried, and keeps ``dead_at`` (and its last error) until an operator requeues it.

Plain Django operations: on PostgreSQL a column or an index added to the partitioned table
reaches every partition, and those created later. A null column is added without rewriting
the table; the index holds dead letters only. Frozen: nothing is imported from the package.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0011_stored_response_permission")]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="dead_at",
            field=models.DateTimeField(null=True, verbose_name="dead letter since"),
        ),
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(
                condition=models.Q(("dead_at__isnull", False)),
                fields=["dead_at"],
                name="idempotency_outbox_dead",
            ),
        ),
    ]
