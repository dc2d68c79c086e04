"""Tombstones and principals stored as digests become keyed digests.

Until now an erasure tombstone's principal was ``erased:`` and the plain SHA-256 (hex) of
the principal, its fingerprint ``{"sha256": ...}``, and a principal too long to store
``sha256:`` and the SHA-256 of it: anyone who reads the table could test guesses against
them (a tombstone was enumerated back to ``user:1``). The app now stores HMAC-SHA256 digests
under keys derived from the database's secret (migration 0008), version ``h1``
(``storage/digests.py``); the digests stored before are keyed here the same way, over the
plain digest they hold, so a claim finds an older tombstone, and a retry of a principal
stored as a digest its records (an exactly-once consumer's principal stays as it is: the
consumers still name a long one by its plain digest). Request fingerprints are not
rewritten (every record would be): a retry of an older record is compared with the plain
digests of its request.

Frozen: the key derivation is written here, nothing is imported from the package. One
UPDATE per kind; each reads the whole records table once (there is no index on the
principal), and writes only the few rows it changes. Not reversible to the plain digests.
"""

from __future__ import annotations

import hashlib
import hmac

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

VERSION = "h1"
_SECRET = "SELECT secret FROM django_idempotency_secret WHERE id = 1"

# (purpose, the prefix of the stored value, the SQL condition of the rows to key).
_SCOPES = (
    ("tombstone", "erased:", "scope LIKE 'erased:%%' AND scope NOT LIKE 'erased:h1:%%'"),
    # Not a consumer's (method TASK): it names a long consumer by a plain digest still.
    (
        "principal",
        "sha256:",
        "scope LIKE 'sha256:%%' AND scope NOT LIKE 'sha256:h1:%%' AND method <> 'TASK'",
    ),
)
# HMAC-SHA256 of a text under padded keys (%s: outer, then inner), with SQL's sha256().
_HMAC_SQL = "encode(sha256(%s || sha256(%s || convert_to({text}, 'UTF8'))), 'hex')"
_KEY_SCOPES = """
UPDATE django_idempotency_record
   SET scope = %s || {hmac}
 WHERE {where}
"""
_KEY_TOMBSTONE_FINGERPRINTS = """
UPDATE django_idempotency_record
   SET fingerprint = jsonb_build_object('digest', 'h1:' || {hmac})
 WHERE status = 2 AND fingerprint ? 'sha256'
"""


def _key(secret: str, purpose: str) -> bytes:
    # As storage/digests.py derives it.
    info = f"django_idempotency digest {VERSION}:{purpose}".encode()
    return hmac.digest(secret.encode(), info + b"\x01", "sha256")


def _pads(key: bytes) -> list[bytes]:
    block = key.ljust(64, b"\x00")
    return [bytes(b ^ 0x5C for b in block), bytes(b ^ 0x36 for b in block)]


def key_digests(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        cursor.execute(_SECRET)
        row = cursor.fetchone()
    if row is None:  # migration 0008 makes it; nothing to key without it
        return
    secret = str(row[0])
    if connection.vendor != "postgresql":
        _key_plain(apps, schema_editor, secret)
        return
    with connection.cursor() as cursor:
        for purpose, prefix, where in _SCOPES:
            new = f"{prefix}{VERSION}:"
            sql = _KEY_SCOPES.format(
                hmac=_HMAC_SQL.format(text=f"substr(scope, {len(prefix) + 1})"), where=where
            )
            cursor.execute(sql, [new, *_pads(_key(secret, purpose))])
        sql = _KEY_TOMBSTONE_FINGERPRINTS.format(
            hmac=_HMAC_SQL.format(text="fingerprint->>'sha256'")
        )
        cursor.execute(sql, _pads(_key(secret, "tombstone-fingerprint")))


def _key_plain(apps: Apps, schema_editor: BaseDatabaseSchemaEditor, secret: str) -> None:
    records = apps.get_model("django_idempotency", "IdempotencyRecord").objects.using(
        schema_editor.connection.alias
    )

    def keyed(purpose: str, plain: str) -> str:
        return hmac.new(_key(secret, purpose), plain.encode(), hashlib.sha256).hexdigest()

    for purpose, prefix, _where in _SCOPES:
        new = f"{prefix}{VERSION}:"
        found = records.filter(scope__startswith=prefix).exclude(scope__startswith=new)
        if purpose == "principal":
            found = found.exclude(method="TASK")
        for record in found:
            scope = new + keyed(purpose, record.scope[len(prefix) :])
            records.filter(pk=record.pk).update(scope=scope)
    for record in records.filter(status=2):
        plain = (record.fingerprint or {}).get("sha256")
        if plain is not None:
            digest = f"{VERSION}:" + keyed("tombstone-fingerprint", plain)
            records.filter(pk=record.pk).update(fingerprint={"digest": digest})


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0016_one_execution_per_generation")]

    operations = [
        migrations.RunPython(
            key_digests, migrations.RunPython.noop, hints={"model_name": "idempotencyrecord"}
        ),
    ]
