"""Let PostgreSQL compress stored response bodies with lz4, where the server has lz4.

Bodies are then stored as they are and compressed by TOAST: storing 1 MB costs about a
third of compressing it with zlib level 1 in the app, and a replay inflates nothing in
Python. On a server built without lz4 nothing changes, and the engine keeps compressing
with zlib (it reads this column's compression once per process).

Altering a partitioned table's column leaves its existing partitions as they were, so each
one is altered too; partition maintenance creates new ones ``LIKE`` the parent
``INCLUDING COMPRESSION``. Only catalog rows change: stored bodies stay as they are, each
readable however it was compressed. Frozen: nothing is imported from the package.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

# {method}: lz4, or default (back to the server's default_toast_compression).
SET_COMPRESSION = """
DO $$
DECLARE
    v_table regclass;
BEGIN
    IF NOT EXISTS (
        SELECT FROM pg_settings
        WHERE name = 'default_toast_compression' AND 'lz4' = ANY (enumvals)
    ) THEN
        RETURN;
    END IF;
    FOR v_table IN
        SELECT 'django_idempotency_record'::regclass
        UNION ALL
        SELECT inhrelid::regclass FROM pg_inherits
        WHERE inhparent = 'django_idempotency_record'::regclass
    LOOP
        EXECUTE format(
            'ALTER TABLE %s ALTER COLUMN response_body SET COMPRESSION {method}', v_table);
    END LOOP;
END $$
"""


def _set_compression(schema_editor: BaseDatabaseSchemaEditor, method: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        # params=None: the DDL contains '%' that must not be read as placeholders.
        schema_editor.execute(SET_COMPRESSION.format(method=method), params=None)


def use_lz4(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _set_compression(schema_editor, "lz4")


def use_default(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _set_compression(schema_editor, "default")


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0002_outbox")]

    operations = [migrations.RunPython(use_lz4, use_default)]
