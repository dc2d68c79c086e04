"""The outbox remembers when to check that an exactly-once consumer ran a published message.

``redrive_at`` is set when the relay marks a message for an exactly-once task published;
the relay then looks for the consumer's record and, if there is none, publishes the message
again (``messaging/redrive.py``); ``redrives`` counts how often. The index holds only rows
still to check, so it stays small however many published rows are kept for audit.

Plain Django operations: on PostgreSQL, a column or an index added to the partitioned table
is added to every partition, and to partitions created later. Both columns are added without
rewriting the table (a null column, and a constant default kept in the database, which the
outbox's own INSERT relies on). Frozen: nothing is imported from the package.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0004_claim_prunes_future_partitions")]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="redrive_at",
            field=models.DateTimeField(null=True, verbose_name="consumer record checked at"),
        ),
        migrations.AddField(
            model_name="outboxmessage",
            name="redrives",
            field=models.IntegerField(db_default=0, default=0, verbose_name="published again"),
        ),
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(
                condition=models.Q(("redrive_at__isnull", False)),
                fields=["redrive_at"],
                name="idempotency_outbox_redrive",
            ),
        ),
    ]
