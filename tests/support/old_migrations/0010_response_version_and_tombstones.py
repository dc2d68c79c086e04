"""Stored responses carry the version of their view, and an erased record stays as a tombstone.

``response_version`` is the version the view declared when the response was stored (null: none
declared). The claim and the lookup take the version the view declares now: the claim answers
``stale`` for a record of another version (the app then refuses a reused key, answers 410 where
a window is configured, or runs the key anew under the lock the claim holds), and the lookup
never returns it.

Erasure (``manage.py idempotency_erase``) keeps a record's row as a tombstone: status 2, its
body and headers gone, its principal replaced by ``erased:`` and the SHA-256 (hex) of the
principal. The claim looks for the principal and its tombstone in the same index probe, and
answers ``expired`` for a tombstone until its record would have expired and left the window:
a retry of an erased key is never run again.

The functions gain parameters with defaults at the end (the claim also takes the tombstone's
principal, which the app computes), so a server still on the previous code calls the new
functions unchanged (its records have no version, it declares none). On PostgreSQL the
column is added to the partitioned parent, which adds it to every partition without a rewrite
(a null column); SQLite adds it in place. Frozen: the SQL is written here, the reverse (0007's,
0006's and 0001's functions) too; nothing is imported from the package.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

ADD_COLUMN = "ALTER TABLE django_idempotency_record ADD COLUMN response_version varchar(64) NULL"
DROP_COLUMN = "ALTER TABLE django_idempotency_record DROP COLUMN response_version"

_CLAIM_SIGNATURE = "interval, interval, integer, timestamptz"
_STORE_SIGNATURE = (
    "text, text, text, text, jsonb, timestamptz, timestamptz, integer, jsonb, bytea, text"
)

CLAIM_FUNCTION = """
CREATE FUNCTION django_idempotency_claim(
    p_lock integer, p_scope text, p_key text, p_window interval, p_gone interval,
    p_wait_ms integer, p_now timestamptz DEFAULT NULL, p_version text DEFAULT NULL,
    p_erased text DEFAULT NULL)
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
    v_erased text;
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
    -- An erased record's principal, as its tombstone holds it: found in the same probe.
    -- The app sends it (a digest here costs the claim more than the lookup: OpenSSL 3
    -- fetches the digest anew on every call); a caller that does not is served too.
    v_erased := coalesce(p_erased, 'erased:' || encode(sha256(convert_to(p_scope, 'UTF8')), 'hex'));
    -- The newest record decides: a tombstone is expired (never run again). A record of
    -- another version is 'stale', with our now() as its created_at: the app compares its
    -- request (another request is a reused key) and answers 410, or runs the key anew, its
    -- record then stored beside the stale one with that created_at, still holding the lock.
    RETURN QUERY
        SELECT s.o, CASE WHEN s.o = 'stale' THEN v_now ELSE s.c END,
               s.e, s.m, s.p, s.f, s.rc, s.rh, s.rb, s.be
          FROM (SELECT CASE WHEN r.status = 2 OR r.expires_at <= v_now THEN 'expired'
                            WHEN r.response_version IS DISTINCT FROM p_version THEN 'stale'
                            ELSE 'found' END AS o,
                       r.created_at AS c, r.expires_at AS e, r.method::text AS m,
                       r.path AS p, r.fingerprint AS f, r.response_code AS rc,
                       r.response_headers AS rh, r.response_body AS rb,
                       r.body_encoding::text AS be
                  FROM django_idempotency_record r
                 WHERE r.key = p_key AND r.scope IN (p_scope, v_erased)
                   AND r.created_at >= v_from
                   AND r.created_at <= v_to
                   AND r.expires_at + p_gone > v_now
                 -- Two records of one transaction's now() (a test's): the later one.
                 ORDER BY r.created_at DESC, r.id DESC
                 LIMIT 1) s;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT 'won'::text, v_now, NULL::timestamptz, NULL::text, NULL::text,
        NULL::jsonb, NULL::smallint, NULL::jsonb, NULL::bytea, NULL::text;
END $$
"""

# The reverse: the function as 0007 created it.
PREVIOUS_CLAIM_FUNCTION = """
CREATE FUNCTION django_idempotency_claim(
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

LOOKUP_FUNCTION = """
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
    -- Only the newest record, and only if it is of the view's version (a tombstone has
    -- another principal): anything else is the claim's to decide.
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

# The reverse: the function as 0006 created it.
PREVIOUS_LOOKUP_FUNCTION = """
CREATE FUNCTION django_idempotency_lookup(
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

STORE_FUNCTION = """
CREATE FUNCTION django_idempotency_store(
    p_scope text, p_key text, p_method text, p_path text, p_fingerprint jsonb,
    p_created_at timestamptz, p_expires_at timestamptz, p_code integer,
    p_headers jsonb, p_body bytea, p_encoding text, p_version text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO django_idempotency_record (scope, key, method, path, fingerprint,
        created_at, expires_at, status, response_code, response_headers, response_body,
        body_encoding, response_version)
    VALUES (p_scope, p_key, p_method, p_path, p_fingerprint, p_created_at, p_expires_at,
        1, p_code, p_headers, p_body, p_encoding, p_version);
END $$
"""

# The reverse: the function as 0001 created it.
PREVIOUS_STORE_FUNCTION = """
CREATE FUNCTION django_idempotency_store(
    p_scope text, p_key text, p_method text, p_path text, p_fingerprint jsonb,
    p_created_at timestamptz, p_expires_at timestamptz, p_code integer,
    p_headers jsonb, p_body bytea, p_encoding text)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO django_idempotency_record (scope, key, method, path, fingerprint,
        created_at, expires_at, status, response_code, response_headers, response_body,
        body_encoding)
    VALUES (p_scope, p_key, p_method, p_path, p_fingerprint, p_created_at, p_expires_at,
        1, p_code, p_headers, p_body, p_encoding);
END $$
"""

FORWARD = [
    ADD_COLUMN,
    # A function with one parameter more is another function: the old one goes first, so
    # that a call without the version is not ambiguous.
    f"DROP FUNCTION django_idempotency_claim(integer, text, text, {_CLAIM_SIGNATURE})",
    CLAIM_FUNCTION,
    "DROP FUNCTION django_idempotency_lookup(text, text, interval)",
    LOOKUP_FUNCTION,
    f"DROP FUNCTION django_idempotency_store({_STORE_SIGNATURE})",
    STORE_FUNCTION,
]

BACKWARD = [
    f"DROP FUNCTION django_idempotency_claim(integer, text, text, {_CLAIM_SIGNATURE}, text, text)",
    PREVIOUS_CLAIM_FUNCTION,
    "DROP FUNCTION django_idempotency_lookup(text, text, interval, text)",
    PREVIOUS_LOOKUP_FUNCTION,
    f"DROP FUNCTION django_idempotency_store({_STORE_SIGNATURE}, text)",
    PREVIOUS_STORE_FUNCTION,
    # Tombstones have no principal to go back to: the records they stand for are gone.
    "DELETE FROM django_idempotency_record WHERE status = 2",
    DROP_COLUMN,
]

STATUS = models.SmallIntegerField(
    choices=[(0, "in progress"), (1, "completed"), (2, "erased")], default=0, verbose_name="status"
)
VERSION = models.CharField(blank=True, max_length=64, null=True, verbose_name="response version")


def forward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    # Plain SQL on SQLite too: its table remake would lose 0001's unique index, which the
    # model does not declare.
    statements = FORWARD if schema_editor.connection.vendor == "postgresql" else [ADD_COLUMN]
    for sql in statements:
        # params=None: the SQL contains '%' that must not be read as placeholders.
        schema_editor.execute(sql, params=None)


def backward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    postgresql = schema_editor.connection.vendor == "postgresql"
    for sql in BACKWARD if postgresql else [BACKWARD[-2], DROP_COLUMN]:
        schema_editor.execute(sql, params=None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0009_probe")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forward, backward)],
            state_operations=[
                migrations.AddField(
                    model_name="idempotencyrecord", name="response_version", field=VERSION
                ),
                migrations.AlterField(model_name="idempotencyrecord", name="status", field=STATUS),
            ],
        )
    ]
