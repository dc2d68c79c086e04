"""The claim reads only the partitions that its window can hold.

The claim's lookup bounded ``created_at`` by ``clock_timestamp()`` inside the query, which
PostgreSQL cannot prune on: every claim scanned every partition, the week made ahead of
today included (a consumer's claim nine or more on a young table). The bounds are now
computed once the lock is held, as variables, and the lookup keeps one generic plan whose
partitions are pruned when it starts: a custom plan would prune as well but is planned again
on every call, which costs more than the scans it saves. Same outcomes as before.

Frozen: the SQL is written here, the reverse (0001's function) too; nothing is imported.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION django_idempotency_claim(
    p_lock integer, p_scope text, p_key text, p_window interval, p_gone interval,
    p_wait_ms integer, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (
    outcome text, created_at timestamptz, expires_at timestamptz, method text,
    path text, fingerprint jsonb, response_code smallint, response_headers jsonb,
    response_body bytea, body_encoding text)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_timeout text;
    v_from timestamptz;
    v_to timestamptz;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1768187245, p_lock) THEN
        IF p_wait_ms <= 0 THEN
            RETURN QUERY SELECT 'busy'::text, NULL::timestamptz, NULL::timestamptz,
                NULL::text, NULL::text, NULL::jsonb, NULL::smallint, NULL::jsonb,
                NULL::bytea, NULL::text;
            RETURN;
        END IF;
        v_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
        BEGIN
            PERFORM pg_advisory_xact_lock(1768187245, p_lock);
        EXCEPTION WHEN lock_not_available THEN
            PERFORM set_config('lock_timeout', v_timeout, true);
            RETURN QUERY SELECT 'busy'::text, NULL::timestamptz, NULL::timestamptz,
                NULL::text, NULL::text, NULL::jsonb, NULL::smallint, NULL::jsonb,
                NULL::bytea, NULL::text;
            RETURN;
        END;
        PERFORM set_config('lock_timeout', v_timeout, true);
    END IF;
    -- Taken once the lock is held. The upper bound uses the wall clock: a record committed
    -- by a transaction that started after ours has a created_at later than our now().
    v_from := v_now - p_window;
    v_to := greatest(v_now, clock_timestamp()) + interval '1 minute';
    RETURN QUERY
        SELECT CASE WHEN r.expires_at > v_now THEN 'found' ELSE 'expired' END,
               r.created_at, r.expires_at, r.method::text, r.path, r.fingerprint,
               r.response_code, r.response_headers, r.response_body, r.body_encoding::text
          FROM django_idempotency_record r
         WHERE r.scope = p_scope AND r.key = p_key
           AND r.created_at >= v_from
           AND r.created_at <= v_to
           AND r.expires_at + p_gone > v_now
         ORDER BY r.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT 'won'::text, v_now, NULL::timestamptz, NULL::text, NULL::text,
        NULL::jsonb, NULL::smallint, NULL::jsonb, NULL::bytea, NULL::text;
END $$
"""


# The reverse: the function as 0001 created it.
PREVIOUS_CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION django_idempotency_claim(
    p_lock integer, p_scope text, p_key text, p_window interval, p_gone interval,
    p_wait_ms integer, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (
    outcome text, created_at timestamptz, expires_at timestamptz, method text,
    path text, fingerprint jsonb, response_code smallint, response_headers jsonb,
    response_body bytea, body_encoding text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_timeout text;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1768187245, p_lock) THEN
        IF p_wait_ms <= 0 THEN
            RETURN QUERY SELECT 'busy'::text, NULL::timestamptz, NULL::timestamptz,
                NULL::text, NULL::text, NULL::jsonb, NULL::smallint, NULL::jsonb,
                NULL::bytea, NULL::text;
            RETURN;
        END IF;
        v_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
        BEGIN
            PERFORM pg_advisory_xact_lock(1768187245, p_lock);
        EXCEPTION WHEN lock_not_available THEN
            PERFORM set_config('lock_timeout', v_timeout, true);
            RETURN QUERY SELECT 'busy'::text, NULL::timestamptz, NULL::timestamptz,
                NULL::text, NULL::text, NULL::jsonb, NULL::smallint, NULL::jsonb,
                NULL::bytea, NULL::text;
            RETURN;
        END;
        PERFORM set_config('lock_timeout', v_timeout, true);
    END IF;
    -- The upper bound uses the wall clock: a record committed by a transaction that
    -- started after ours has a created_at later than our now().
    RETURN QUERY
        SELECT CASE WHEN r.expires_at > v_now THEN 'found' ELSE 'expired' END,
               r.created_at, r.expires_at, r.method::text, r.path, r.fingerprint,
               r.response_code, r.response_headers, r.response_body, r.body_encoding::text
          FROM django_idempotency_record r
         WHERE r.scope = p_scope AND r.key = p_key
           AND r.created_at >= v_now - p_window
           AND r.created_at <= greatest(v_now, clock_timestamp()) + interval '1 minute'
           AND r.expires_at + p_gone > v_now
         ORDER BY r.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT 'won'::text, v_now, NULL::timestamptz, NULL::text, NULL::text,
        NULL::jsonb, NULL::smallint, NULL::jsonb, NULL::bytea, NULL::text;
END $$
"""


def _create(schema_editor: BaseDatabaseSchemaEditor, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        # params=None: the SQL contains '%' that must not be read as placeholders.
        schema_editor.execute(sql, params=None)


def prune(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _create(schema_editor, CLAIM_FUNCTION)


def restore(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _create(schema_editor, PREVIOUS_CLAIM_FUNCTION)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0003_response_body_lz4")]

    operations = [migrations.RunPython(prune, restore)]
