"""The lookup answers exactly what the claim would find.

The lookup (a replay in one statement, outside any transaction) becomes the default path of a
request, so it must never replay what the claim would refuse. It now reads the records the
claim reads (the principal's and its tombstone's, in the claim's window from the claim's now,
newest first in the claim's order) and answers only when the newest is what the claim would
answer ``found`` with: completed (not a tombstone), of the principal, not expired, of the
view's version. It refuses to run at REPEATABLE READ or SERIALIZABLE with the claim's error
(SQLSTATE ``0AI01``). Anything else, it answers nothing, and the claim decides.

Frozen: the SQL is written here, the reverse (0010's lookup) too; nothing is imported from
the package.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

LOOKUP_FUNCTION = """
CREATE FUNCTION django_idempotency_lookup(
    p_scope text, p_key text, p_window interval, p_now timestamptz, p_version text,
    p_erased text)
RETURNS TABLE (
    outcome text, created_at timestamptz, expires_at timestamptz, method text,
    path text, fingerprint jsonb, response_code smallint, response_headers jsonb,
    response_body bytea, body_encoding text)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_from timestamptz := v_now - p_window;
    v_to timestamptz := greatest(v_now, clock_timestamp()) + interval '1 minute';
BEGIN
    -- What the claim refuses, the lookup refuses alike (migration 0007).
    IF current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION USING
            ERRCODE = '0AI01',
            MESSAGE = 'django_idempotency_lookup() refuses to run at isolation level '
                || current_setting('transaction_isolation')
                || ': the claim needs READ COMMITTED to see a record committed while it waited',
            DETAIL = current_setting('transaction_isolation'),
            HINT = 'Run the records'' database at READ COMMITTED: reset '
                || 'default_transaction_isolation (ALTER DATABASE/ROLE ... RESET, libpq '
                || 'options) and drop isolation_level from DATABASES OPTIONS.';
    END IF;
    -- The claim's newest record (its rows, its order); answered only where the claim would
    -- answer 'found' with it.
    RETURN QUERY
        SELECT 'found'::text, s.c, s.e, s.m, s.p, s.f, s.rc, s.rh, s.rb, s.be FROM (
            SELECT r.status AS st, r.scope AS sc, r.created_at AS c, r.expires_at AS e,
                   r.method::text AS m, r.path AS p, r.fingerprint AS f,
                   r.response_code AS rc, r.response_headers AS rh, r.response_body AS rb,
                   r.body_encoding::text AS be, r.response_version AS v
              FROM django_idempotency_record r
             WHERE r.key = p_key AND r.scope IN (p_scope, p_erased)
               AND r.created_at >= v_from
               AND r.created_at <= v_to
             ORDER BY r.created_at DESC, r.generation DESC, r.id DESC
             LIMIT 1) s
         WHERE s.st = 1 AND s.sc = p_scope AND s.e > v_now
           AND s.v IS NOT DISTINCT FROM p_version;
END $$
"""

# The reverse: the function as 0010 created it.
PREVIOUS_LOOKUP_FUNCTION = """
CREATE FUNCTION django_idempotency_lookup(
    p_scope text, p_key text, p_window interval, p_version text DEFAULT NULL)
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
        SELECT 'found'::text, s.c, s.e, s.m, s.p, s.f, s.rc, s.rh, s.rb, s.be FROM (
            SELECT r.created_at AS c, r.expires_at AS e, r.method::text AS m, r.path AS p,
                   r.fingerprint AS f, r.response_code AS rc, r.response_headers AS rh,
                   r.response_body AS rb, r.body_encoding::text AS be, r.response_version AS v
              FROM django_idempotency_record r
             WHERE r.scope = p_scope AND r.key = p_key
               AND r.created_at >= v_from
               AND r.created_at <= v_to
               AND r.expires_at > v_now
             ORDER BY r.created_at DESC, r.id DESC
             LIMIT 1) s
         WHERE s.v IS NOT DISTINCT FROM p_version;
END $$
"""

FORWARD = [
    "DROP FUNCTION django_idempotency_lookup(text, text, interval, text)",
    LOOKUP_FUNCTION,
]
BACKWARD = [
    "DROP FUNCTION django_idempotency_lookup(text, text, interval, timestamptz, text, text)",
    PREVIOUS_LOOKUP_FUNCTION,
]


def forward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for sql in FORWARD:
            # params=None: the SQL contains '%' that must not be read as placeholders.
            schema_editor.execute(sql, params=None)


def backward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for sql in BACKWARD:
            schema_editor.execute(sql, params=None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0018_stored_error_counts")]

    operations = [migrations.RunPython(forward, backward)]
