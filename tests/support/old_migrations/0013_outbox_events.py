"""Create the event table for change data capture: insert-only, in the shape Debezium's
outbox event router reads; partitioned by day on PostgreSQL, a plain table elsewhere.

As for the outbox, Django's state sees ``id`` as the primary key; on PostgreSQL the real key
is ``(id, created_at)``. No publication here: creating one needs rights an app's role often
lacks, so ``manage.py idempotency_cdc publication`` makes it (or prints it for a DBA).
Frozen: the SQL is written here, nothing is imported from the package.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

PARTITIONED_TABLE = """
CREATE TABLE django_idempotency_outbox_event (
    id            uuid         NOT NULL,
    created_at    timestamptz  NOT NULL,
    aggregatetype varchar(255) NOT NULL,
    aggregateid   varchar(255) NOT NULL,
    type          varchar(255) NOT NULL,
    payload       jsonb        NULL,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at)
"""

PARTITION_COMMENT = "django_idempotency:auto"
# Yesterday (a clock a little behind) to a week ahead, as for the outbox; partition
# maintenance keeps it going.
INITIAL_DAYS = range(-1, 8)


def _partition_statements(day: datetime) -> list[str]:
    name = f"django_idempotency_outbox_event_p{day:%Y%m%d}"
    end = day + timedelta(days=1)
    return [
        f'CREATE TABLE "{name}" PARTITION OF django_idempotency_outbox_event '
        f"FOR VALUES FROM ('{day.isoformat()}') TO ('{end.isoformat()}')",
        f"COMMENT ON TABLE \"{name}\" IS '{PARTITION_COMMENT}'",
    ]


def create_table(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.create_model(apps.get_model("django_idempotency", "OutboxEvent"))
        return
    schema_editor.execute(PARTITIONED_TABLE, params=None)
    now = datetime.now(UTC)
    today = datetime(now.year, now.month, now.day, tzinfo=UTC)
    for offset in INITIAL_DAYS:
        for statement in _partition_statements(today + timedelta(days=offset)):
            schema_editor.execute(statement, params=None)


def drop_table(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.delete_model(apps.get_model("django_idempotency", "OutboxEvent"))
        return
    # Its partitions go with it, and it leaves any publication that names it.
    schema_editor.execute("DROP TABLE IF EXISTS django_idempotency_outbox_event", params=None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0012_outbox_dead_letters")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="OutboxEvent",
                    fields=[
                        (
                            "id",
                            models.UUIDField(
                                primary_key=True, serialize=False, verbose_name="event id"
                            ),
                        ),
                        ("created_at", models.DateTimeField(verbose_name="created at")),
                        (
                            "aggregate_type",
                            models.CharField(
                                db_column="aggregatetype",
                                max_length=255,
                                verbose_name="aggregate type",
                            ),
                        ),
                        (
                            "aggregate_id",
                            models.CharField(
                                db_column="aggregateid", max_length=255, verbose_name="aggregate id"
                            ),
                        ),
                        (
                            "event_type",
                            models.CharField(
                                db_column="type", max_length=255, verbose_name="event type"
                            ),
                        ),
                        ("payload", models.JSONField(null=True, verbose_name="payload")),
                    ],
                    options={
                        "verbose_name": "outbox event (CDC)",
                        "verbose_name_plural": "outbox events (CDC)",
                        "db_table": "django_idempotency_outbox_event",
                    },
                ),
            ],
            database_operations=[],
        ),
        # After the state operation, so apps.get_model() sees the model on other backends.
        migrations.RunPython(create_table, drop_table),
    ]
