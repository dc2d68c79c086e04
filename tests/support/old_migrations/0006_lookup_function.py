"""The lock-free lookup (``IDEMPOTENCY_LOOKUP_FIRST``) becomes a function with one cached plan.

It was a plain ``SELECT`` bound on the server as an unnamed statement, so PostgreSQL planned
it again on every call, across every partition, and without an upper bound on ``created_at``
it could not leave out the week of partitions made ahead of today: on a young table the
lookup cost more than the claim's whole transaction, and a replay with ``lookup_first`` came
out dearer than one without it. As a plpgsql function it keeps one generic plan per
connection whose partitions are pruned when it starts, as the claim's lookup does (0004);
its bounds are the claim's. Same answers as before: a record still live, or nothing.

Frozen: the SQL is written here and nothing is imported.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

LOOKUP_FUNCTION = """
CREATE OR REPLACE FUNCTION django_idempotency_lookup(
    p_scope text, p_key text, p_window interval)
RETURNS TABLE (
    outcome text, created_at timestamptz, expires_at timestamptz, method text,
    path text, fingerprint jsonb, response_code smallint, response_headers jsonb,
    response_body bytea, body_encoding text)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := now();
    v_from timestamptz := v_now - p_window;
    v_to timestamptz := v_now + interval '1 minute';
BEGIN
    RETURN QUERY
        SELECT 'found'::text, r.created_at, r.expires_at, r.method::text, r.path,
               r.fingerprint, r.response_code, r.response_headers, r.response_body,
               r.body_encoding::text
          FROM django_idempotency_record r
         WHERE r.scope = p_scope AND r.key = p_key
           AND r.created_at >= v_from
           AND r.created_at <= v_to
           AND r.expires_at > v_now
         ORDER BY r.created_at DESC
         LIMIT 1;
END $$
"""

DROP_LOOKUP_FUNCTION = "DROP FUNCTION IF EXISTS django_idempotency_lookup(text, text, interval)"


def _execute(schema_editor: BaseDatabaseSchemaEditor, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        # params=None: the SQL contains '%' that must not be read as placeholders.
        schema_editor.execute(sql, params=None)


def create(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _execute(schema_editor, LOOKUP_FUNCTION)


def drop(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _execute(schema_editor, DROP_LOOKUP_FUNCTION)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0005_outbox_redrive")]

    operations = [migrations.RunPython(create, drop)]
