"""The claim refuses to run at REPEATABLE READ or SERIALIZABLE, as it did before 0004.

At those levels a transaction's snapshot is taken by its first statement, before the claim
holds the key's lock: a duplicate that waited for the lock does not see the record that the
holder committed meanwhile, finds nothing, and runs the key again (REPEATABLE READ committed
it again; SERIALIZABLE ran the work again and failed only at its commit). The claim now
raises SQLSTATE 0AI01 before it takes the lock, wherever the level was set: the database's
or the role's default, the connection's options, Django's OPTIONS. Same outcomes as 0004
at READ COMMITTED.

Frozen: the SQL is written here, the reverse (0004's function) too; nothing is imported.
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
    -- Before the lock: a snapshot that predates the lock (REPEATABLE READ, SERIALIZABLE)
    -- never sees the record that the lock's previous holder committed.
    IF current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION USING
            ERRCODE = '0AI01',
            MESSAGE = 'django_idempotency_claim() refuses to run at isolation level '
                || current_setting('transaction_isolation')
                || ': it needs READ COMMITTED to see a record committed while it waited',
            DETAIL = current_setting('transaction_isolation'),
            HINT = 'Run the records'' database at READ COMMITTED: reset '
                || 'default_transaction_isolation (ALTER DATABASE/ROLE ... RESET, libpq '
                || 'options) and drop isolation_level from DATABASES OPTIONS.';
    END IF;
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


# The reverse: the function as 0004 created it.
PREVIOUS_CLAIM_FUNCTION = """
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


def _create(schema_editor: BaseDatabaseSchemaEditor, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        # params=None: the SQL contains '%' that must not be read as placeholders.
        schema_editor.execute(sql, params=None)


def refuse(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _create(schema_editor, CLAIM_FUNCTION)


def restore(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _create(schema_editor, PREVIOUS_CLAIM_FUNCTION)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0006_lookup_function")]

    operations = [migrations.RunPython(refuse, restore)]
