"""A secret of the app's own, made here at random, in a table of its own.

The lock that serialises a key and the downstream keys are keyed hashes. Their secret was
``SECRET_KEY`` (unless ``IDEMPOTENCY_SECRET_KEY`` was set), so two app servers with different
``SECRET_KEY`` values (a rolling rotation, a secret per pod) took different locks for one key
and both ran it. The secret now lives in the database every server claims in, so they share
it by construction; the app reads it once per process and database.

Also ``django_idempotency_lock_all()``: the locks under every configured secret, taken in one
statement before the claim while ``IDEMPOTENCY_SECRET_KEY_FALLBACKS`` is set, so that servers
on both sides of a rotation still serialise a key. The claim function is left as it is.

Frozen: the SQL is written here and nothing is imported from the package. The table goes
where the records go (the routers are asked about ``IdempotencyRecord``), on any database.
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.utils.crypto import get_random_string

# One row, id 1. Not a model: nothing but this app reads it, and a test database flush
# (TransactionTestCase) must not empty it.
SECRET_TABLE = """
CREATE TABLE django_idempotency_secret (
    id     integer      NOT NULL PRIMARY KEY CHECK (id = 1),
    secret varchar(128) NOT NULL
)
"""
INSERT_SECRET = "INSERT INTO django_idempotency_secret (id, secret) VALUES (1, %s)"
DROP_SECRET_TABLE = "DROP TABLE django_idempotency_secret"

# The locks ``p_locks`` (the caller sorts them: every transaction takes them in one order,
# so two never wait for each other), within ``p_wait_ms`` in all; false if one is held
# elsewhere past that. In the claim's lock space (1768187245); advisory locks are re-entrant,
# so the claim that follows takes its own lock, one of these, at once.
LOCK_ALL_FUNCTION = """
CREATE OR REPLACE FUNCTION django_idempotency_lock_all(p_locks integer[], p_wait_ms integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_lock integer;
    v_timeout text := current_setting('lock_timeout');
    v_deadline timestamptz := clock_timestamp() + p_wait_ms * interval '1 millisecond';
    v_left integer;
BEGIN
    FOREACH v_lock IN ARRAY p_locks LOOP
        CONTINUE WHEN pg_try_advisory_xact_lock(1768187245, v_lock);
        v_left := ceil(extract(epoch FROM v_deadline - clock_timestamp()) * 1000);
        IF v_left <= 0 THEN
            RETURN false;
        END IF;
        PERFORM set_config('lock_timeout', v_left || 'ms', true);
        BEGIN
            PERFORM pg_advisory_xact_lock(1768187245, v_lock);
        EXCEPTION WHEN lock_not_available THEN
            PERFORM set_config('lock_timeout', v_timeout, true);
            RETURN false;
        END;
        PERFORM set_config('lock_timeout', v_timeout, true);
    END LOOP;
    RETURN true;
END $$
"""
DROP_LOCK_ALL_FUNCTION = "DROP FUNCTION IF EXISTS django_idempotency_lock_all(integer[], integer)"


def create(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    connection = schema_editor.connection
    schema_editor.execute(SECRET_TABLE, params=None)
    # Not through the schema editor, which logs its statements with their parameters.
    with connection.cursor() as cursor:
        # 64 letters and digits from the secrets module: 381 random bits.
        cursor.execute(INSERT_SECRET, [get_random_string(64)])
    if connection.vendor == "postgresql":
        # params=None: the SQL contains '%' that must not be read as placeholders.
        schema_editor.execute(LOCK_ALL_FUNCTION, params=None)


def drop(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_LOCK_ALL_FUNCTION, params=None)
    schema_editor.execute(DROP_SECRET_TABLE, params=None)


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0007_claim_refuses_repeatable_read")]

    operations = [
        migrations.RunPython(create, drop, hints={"model_name": "idempotencyrecord"}),
    ]
