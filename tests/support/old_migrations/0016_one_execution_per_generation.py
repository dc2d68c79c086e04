"""The database itself refuses a second execution of a key: a record carries its generation,
and each partition has a unique index on (key, scope, generation).

The advisory lock serialises a key; until now nothing else did, so a lock that failed to
serialise (servers keyed with two secrets, a bug) let two executions of one key commit. The
claim now answers, with ``won``, the generation of the execution it starts: one more than
the highest generation of the key's records it reads (0 for a key without one). Two
executions that both won without seeing each other carry the same generation, and the second
to store violates the unique index: it rolls back and is answered as a duplicate. A key that
expired, was erased, or runs anew under another version starts the next generation, so it is
never refused for its predecessor.

A unique index of a partitioned table must contain the partition key (``created_at``), which
would make it useless here, so the index is made on each partition (maintenance makes it on
every new one, ``partitions.apply``): it refuses a second execution within one UTC day.
Across a partition boundary (one execution claimed before midnight UTC, its duplicate after)
the lock is the only guard.

To find that highest generation, the claim reads the key's records from the start of the
current partition too when its window is shorter than a day, and the newest of them decides
(one whose ``expires_at`` is past the window is answered ``won``, as before).

Existing records get generation 0; where one partition holds several records of one key (a
key that ran anew after it expired), they are numbered in order first, so the index can be
made. ``CREATE UNIQUE INDEX`` holds writes to each partition while it builds (a few seconds
per million records). Frozen: the SQL is written here; nothing is imported from the package.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

ADD_COLUMN = (
    "ALTER TABLE django_idempotency_record ADD COLUMN generation integer NOT NULL DEFAULT 0"
)
DROP_COLUMN = "ALTER TABLE django_idempotency_record DROP COLUMN generation"

# The partitions attached to the records table, by name.
PARTITIONS = """
SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'django_idempotency_record'::regclass ORDER BY c.relname
"""
# Several records of one key in one partition (a key run anew after it expired): numbered
# 0, 1, 2... in the order they were made.
NUMBER_GENERATIONS = """
UPDATE {partition} r SET generation = n.g
  FROM (SELECT id, created_at,
               row_number() OVER (PARTITION BY key, scope ORDER BY created_at, id) - 1 AS g
          FROM {partition}
         WHERE (key, scope) IN (SELECT key, scope FROM {partition}
                                 GROUP BY key, scope HAVING count(*) > 1)) n
 WHERE r.id = n.id AND r.created_at = n.created_at AND n.g > 0
"""
# The index's name is the partition's and this suffix (partitions.apply makes the same).
ONE_EXECUTION = "CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {partition} (key, scope, generation)"
INDEX_SUFFIX = "_one_execution"

_CLAIM_SIGNATURE = "integer, text, text, interval, interval, integer, timestamptz, text, text"
_STORE_SIGNATURE = (
    "text, text, text, text, jsonb, timestamptz, timestamptz, integer, jsonb, bytea, text, text"
)

CLAIM_FUNCTION = """
CREATE FUNCTION django_idempotency_claim(
    p_lock integer, p_scope text, p_key text, p_window interval, p_gone interval,
    p_wait_ms integer, p_now timestamptz DEFAULT NULL, p_version text DEFAULT NULL,
    p_erased text DEFAULT NULL)
RETURNS TABLE (
    outcome text, created_at timestamptz, expires_at timestamptz, method text,
    path text, fingerprint jsonb, response_code smallint, response_headers jsonb,
    response_body bytea, body_encoding text, generation integer)
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
                NULL::bytea, NULL::text, NULL::integer;
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
                NULL::bytea, NULL::text, NULL::integer;
            RETURN;
        END;
        PERFORM set_config('lock_timeout', v_timeout, true);
    END IF;
    -- Taken once the lock is held. The upper bound uses the wall clock: a record committed
    -- by a transaction that started after ours has a created_at later than our now().
    v_from := v_now - p_window;
    v_to := greatest(v_now, clock_timestamp()) + interval '1 minute';
    -- An erased record's principal, as its tombstone holds it: found in the same probe.
    v_erased := coalesce(p_erased, 'erased:' || encode(sha256(convert_to(p_scope, 'UTF8')), 'hex'));
    -- The newest record decides: one past the window or the 410 window is no longer there
    -- (won), a tombstone is expired (never run again), one of another version is 'stale',
    -- with our now() as its created_at. The generation of an execution that starts (won,
    -- stale) is one more than the highest of the key's records read, which include every
    -- record of the key in the partition our record goes to (from the start of its UTC day,
    -- should the window be shorter): its unique index then refuses a second execution.
    RETURN QUERY
        SELECT s.o, CASE WHEN s.o IN ('stale', 'won') THEN v_now ELSE s.c END,
               s.e, s.m, s.p, s.f, s.rc, s.rh, s.rb, s.be, s.g
          FROM (SELECT CASE WHEN r.created_at < v_from OR r.expires_at + p_gone <= v_now
                                 THEN 'won'
                            WHEN r.status = 2 OR r.expires_at <= v_now THEN 'expired'
                            WHEN r.response_version IS DISTINCT FROM p_version THEN 'stale'
                            ELSE 'found' END AS o,
                       r.created_at AS c, r.expires_at AS e, r.method::text AS m,
                       r.path AS p, r.fingerprint AS f, r.response_code AS rc,
                       r.response_headers AS rh, r.response_body AS rb,
                       r.body_encoding::text AS be,
                       max(r.generation) OVER () + 1 AS g
                  FROM django_idempotency_record r
                 WHERE r.key = p_key AND r.scope IN (p_scope, v_erased)
                   AND r.created_at >= least(v_from,
                       date_trunc('day', v_now AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')
                   AND r.created_at <= v_to
                 -- Two records of one transaction's now() (a test's): the later one.
                 ORDER BY r.created_at DESC, r.generation DESC, r.id DESC
                 LIMIT 1) s;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT 'won'::text, v_now, NULL::timestamptz, NULL::text, NULL::text,
        NULL::jsonb, NULL::smallint, NULL::jsonb, NULL::bytea, NULL::text, 0;
END $$
"""

# The reverse: the function as 0010 created it.
PREVIOUS_CLAIM_FUNCTION = """
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
    v_from := v_now - p_window;
    v_to := greatest(v_now, clock_timestamp()) + interval '1 minute';
    v_erased := coalesce(p_erased, 'erased:' || encode(sha256(convert_to(p_scope, 'UTF8')), 'hex'));
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
                 ORDER BY r.created_at DESC, r.id DESC
                 LIMIT 1) s;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT 'won'::text, v_now, NULL::timestamptz, NULL::text, NULL::text,
        NULL::jsonb, NULL::smallint, NULL::jsonb, NULL::bytea, NULL::text;
END $$
"""

STORE_FUNCTION = """
CREATE FUNCTION django_idempotency_store(
    p_scope text, p_key text, p_method text, p_path text, p_fingerprint jsonb,
    p_created_at timestamptz, p_expires_at timestamptz, p_code integer,
    p_headers jsonb, p_body bytea, p_encoding text, p_version text DEFAULT NULL,
    p_generation integer DEFAULT 0)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO django_idempotency_record (scope, key, method, path, fingerprint,
        created_at, expires_at, status, response_code, response_headers, response_body,
        body_encoding, response_version, generation)
    VALUES (p_scope, p_key, p_method, p_path, p_fingerprint, p_created_at, p_expires_at,
        1, p_code, p_headers, p_body, p_encoding, p_version, p_generation);
END $$
"""

# The reverse: the function as 0010 created it.
PREVIOUS_STORE_FUNCTION = """
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

FUNCTIONS = [
    # Another result type, or one parameter more, is another function: the old one goes.
    f"DROP FUNCTION django_idempotency_claim({_CLAIM_SIGNATURE})",
    CLAIM_FUNCTION,
    f"DROP FUNCTION django_idempotency_store({_STORE_SIGNATURE})",
    STORE_FUNCTION,
]

PREVIOUS_FUNCTIONS = [
    f"DROP FUNCTION django_idempotency_claim({_CLAIM_SIGNATURE})",
    PREVIOUS_CLAIM_FUNCTION,
    f"DROP FUNCTION django_idempotency_store({_STORE_SIGNATURE}, integer)",
    PREVIOUS_STORE_FUNCTION,
]

GENERATION = models.IntegerField(default=0, editable=False, verbose_name="generation")


def _partitions(schema_editor: BaseDatabaseSchemaEditor) -> list[str]:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(PARTITIONS)
        return [row[0] for row in cursor.fetchall()]


def forward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    # params=None: the SQL contains '%' that must not be read as placeholders.
    schema_editor.execute(ADD_COLUMN, params=None)
    if schema_editor.connection.vendor != "postgresql":
        return  # one row per key there: 0001's unique index on (key, scope) refuses a second
    qn = schema_editor.quote_name
    for partition in _partitions(schema_editor):
        schema_editor.execute(NUMBER_GENERATIONS.format(partition=qn(partition)), params=None)
        index = qn(partition + INDEX_SUFFIX)
        schema_editor.execute(
            ONE_EXECUTION.format(index=index, partition=qn(partition)), params=None
        )
    for sql in FUNCTIONS:
        schema_editor.execute(sql, params=None)


def backward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for sql in PREVIOUS_FUNCTIONS:
            schema_editor.execute(sql, params=None)
    # The per-partition indexes go with the column.
    schema_editor.execute(DROP_COLUMN, params=None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0015_relay_heartbeats")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forward, backward)],
            state_operations=[
                migrations.AddField(
                    model_name="idempotencyrecord", name="generation", field=GENERATION
                ),
            ],
        )
    ]
