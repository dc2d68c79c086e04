"""Create the outbox table: partitioned by day on PostgreSQL, a plain table elsewhere.

As for the records, Django's state sees ``id`` as the primary key; on PostgreSQL the real key
is ``(id, created_at)``. Frozen: the SQL is written here, nothing is imported from the package.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

PARTITIONED_TABLE = """
CREATE TABLE django_idempotency_outbox (
    id           uuid         NOT NULL,
    created_at   timestamptz  NOT NULL,
    kind         smallint     NOT NULL,
    name         varchar(255) NOT NULL,
    args         jsonb        NOT NULL DEFAULT '[]',
    kwargs       jsonb        NOT NULL DEFAULT '{}',
    payload      jsonb        NULL,
    options      jsonb        NOT NULL DEFAULT '{}',
    published_at timestamptz  NULL,
    attempts     integer      NOT NULL DEFAULT 0,
    last_error   text         NOT NULL DEFAULT '',
    lease_owner  varchar(64)  NOT NULL DEFAULT '',
    lease_until  timestamptz  NULL,
    fence        bigint       NOT NULL DEFAULT 0,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at)
"""

# Only unpublished rows: small however many published rows are kept for audit.
PENDING_INDEX = (
    "CREATE INDEX idempotency_outbox_pending ON django_idempotency_outbox (created_at) "
    "WHERE published_at IS NULL"
)

# Each claim takes the next value for all the rows it leases: a relay may mark only rows
# that still carry its own fence, so one whose lease expired and was taken over cannot.
FENCE_SEQUENCE = "CREATE SEQUENCE django_idempotency_outbox_fence"

PARTITION_COMMENT = "django_idempotency:auto"
# Yesterday (a clock a little behind) to a week ahead: the app works as soon as migrate has
# run, and partition maintenance keeps it going.
INITIAL_DAYS = range(-1, 8)


def _partition_statements(day: datetime) -> list[str]:
    name = f"django_idempotency_outbox_p{day:%Y%m%d}"
    end = day + timedelta(days=1)
    return [
        f'CREATE TABLE "{name}" PARTITION OF django_idempotency_outbox '
        f"FOR VALUES FROM ('{day.isoformat()}') TO ('{end.isoformat()}')",
        f"COMMENT ON TABLE \"{name}\" IS '{PARTITION_COMMENT}'",
    ]


def create_table(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.create_model(apps.get_model("django_idempotency", "OutboxMessage"))
        return
    for statement in (PARTITIONED_TABLE, PENDING_INDEX, FENCE_SEQUENCE):
        schema_editor.execute(statement, params=None)
    now = datetime.now(UTC)
    today = datetime(now.year, now.month, now.day, tzinfo=UTC)
    for offset in INITIAL_DAYS:
        for statement in _partition_statements(today + timedelta(days=offset)):
            schema_editor.execute(statement, params=None)


def drop_table(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.delete_model(apps.get_model("django_idempotency", "OutboxMessage"))
        return
    # Dropping the parent drops its partitions with it.
    schema_editor.execute("DROP TABLE IF EXISTS django_idempotency_outbox", params=None)
    schema_editor.execute("DROP SEQUENCE IF EXISTS django_idempotency_outbox_fence", params=None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="OutboxMessage",
                    fields=[
                        (
                            "id",
                            models.UUIDField(
                                primary_key=True, serialize=False, verbose_name="message id"
                            ),
                        ),
                        ("created_at", models.DateTimeField(verbose_name="created at")),
                        (
                            "kind",
                            models.SmallIntegerField(
                                choices=[(0, "task"), (1, "event")], verbose_name="kind"
                            ),
                        ),
                        ("name", models.CharField(max_length=255, verbose_name="task or topic")),
                        (
                            "args",
                            models.JSONField(default=list, verbose_name="positional arguments"),
                        ),
                        (
                            "kwargs",
                            models.JSONField(default=dict, verbose_name="keyword arguments"),
                        ),
                        ("payload", models.JSONField(null=True, verbose_name="event payload")),
                        ("options", models.JSONField(default=dict, verbose_name="publish options")),
                        (
                            "published_at",
                            models.DateTimeField(null=True, verbose_name="published at"),
                        ),
                        (
                            "attempts",
                            models.IntegerField(default=0, verbose_name="failed attempts"),
                        ),
                        (
                            "last_error",
                            models.TextField(blank=True, default="", verbose_name="last error"),
                        ),
                        (
                            "lease_owner",
                            models.CharField(
                                blank=True, default="", max_length=64, verbose_name="lease owner"
                            ),
                        ),
                        (
                            "lease_until",
                            models.DateTimeField(null=True, verbose_name="leased or held until"),
                        ),
                        ("fence", models.BigIntegerField(default=0, verbose_name="fence")),
                    ],
                    options={
                        "verbose_name": "outbox message",
                        "verbose_name_plural": "outbox messages",
                        "db_table": "django_idempotency_outbox",
                        "indexes": [
                            models.Index(
                                condition=models.Q(("published_at__isnull", True)),
                                fields=["created_at"],
                                name="idempotency_outbox_pending",
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
        # After the state operation, so apps.get_model() sees the model on other backends.
        migrations.RunPython(create_table, drop_table),
    ]
