"""What the records' database runs: PostgreSQL or the fallback (W003), an isolation level the
claim refuses (E007, from OPTIONS and from a live connection), ATOMIC_REQUESTS elsewhere (W002),
an IDEMPOTENCY_SECRET_KEY that is not the database's secret (E016)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.db import DatabaseError, connections, router, transaction
from django.utils.translation import gettext as _

from django_idempotency.checks.base import ours
from django_idempotency.conf import conf, wrong_type
from django_idempotency.engine.hashing import MISMATCH_FIX, secret_mismatch
from django_idempotency.models import IdempotencyRecord
from django_idempotency.storage.secret import SecretMissing

# The levels whose snapshot is taken before the claim holds the key's lock (the claim refuses them).
REFUSED_LEVELS = frozenset({"repeatable read", "serializable"})

# pg_settings.source of default_transaction_isolation: the statement or file that set a level
# that DATABASES does not show (level_source says the others).
LEVEL_STATEMENTS = {
    "database": "ALTER DATABASE ... SET default_transaction_isolation",
    "user": "ALTER ROLE ... SET default_transaction_isolation",
    "database user": "ALTER ROLE ... IN DATABASE ... SET default_transaction_isolation",
    "configuration file": "postgresql.conf",
}


def level_source(source: str) -> str:
    """Where a level that DATABASES does not show was set."""
    if source == "client":
        return _("the connection's options (OPTIONS['options'] or PGOPTIONS)")
    if source == "session":
        return _("SET default_transaction_isolation on the connection")
    return LEVEL_STATEMENTS.get(source, source)


@register()
def check_databases(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """What the DATABASES setting means for the records' database; no query is made."""
    if not ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    alias = router.db_for_write(IdempotencyRecord)
    connection = connections[alias]
    if connection.vendor != "postgresql":
        messages.append(
            CheckWarning(
                _(
                    "Idempotency records are stored on %(vendor)s (database %(alias)r) in a "
                    "plain table: expired records leave by batched DELETEs and a duplicate "
                    "request gets 409 at once instead of waiting for the replay."
                )
                % {"vendor": connection.display_name, "alias": alias},
                hint=_("This fallback is meant for development; use PostgreSQL in production."),
                id="django_idempotency.W003",
            )
        )
    else:
        level = _refused_in_options(alias)
        if level is not None:
            messages.append(_isolation_refused(alias, level, _in_options(alias)))
    for other in connections:
        if other != alias and connections[other].settings_dict.get("ATOMIC_REQUESTS"):
            messages.append(
                CheckWarning(
                    _(
                        "ATOMIC_REQUESTS is on for database %(other)r, but idempotency records "
                        "are stored on %(alias)r: the record commits before the request's "
                        "transaction on %(other)r does, so if that commit fails, retries "
                        "replay a response whose writes never happened."
                    )
                    % {"other": other, "alias": alias},
                    hint=_(
                        "Route IdempotencyRecord to the database your idempotent views write "
                        "to; only writes to that database commit together with the record."
                    ),
                    id="django_idempotency.W002",
                )
            )
    return messages


@register(Tags.database)
def check_isolation(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """The isolation level a transaction on each records' database actually gets, wherever
    it was set (check_databases sees only OPTIONS, without a query)."""
    if not ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    records = router.db_for_write(IdempotencyRecord)
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql" or not router.allow_migrate_model(
            alias, IdempotencyRecord
        ):
            continue
        in_options = _refused_in_options(alias) is not None
        if in_options and alias == records:
            continue  # said by check_databases, without a query
        try:
            # In a transaction, as the claim runs: Django's OPTIONS, the database's and the
            # role's defaults and the connection's options all show here.
            with transaction.atomic(using=alias), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('transaction_isolation'), source FROM pg_settings "
                    "WHERE name = 'default_transaction_isolation'"
                )
                level, source = cursor.fetchone()
        except DatabaseError:
            continue  # unreachable: the request path answers 503 and says so
        if level in REFUSED_LEVELS:
            where = _in_options(alias) if in_options else level_source(source)
            messages.append(_isolation_refused(alias, level, where))
    return messages


@register(Tags.database)
def check_secret(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """An ``IDEMPOTENCY_SECRET_KEY`` that is not the secret of a records' database: every
    claim of this server there is refused."""
    # A setting of the wrong type is E013's.
    if not ours(app_configs) or wrong_type("SECRET_KEY") or conf.SECRET_KEY is None:
        return []
    messages: list[CheckMessage] = []
    for alias in databases or ():
        if not router.allow_migrate_model(alias, IdempotencyRecord):
            continue
        try:
            problem = secret_mismatch(alias)
        except (DatabaseError, SecretMissing):
            continue  # not migrated yet, or unreachable: the request path says so
        if problem is not None:
            messages.append(
                Error(
                    _(
                        "%(problem)s, so every idempotent request and exactly-once task this "
                        "server claims there is refused (500 misconfigured)."
                    )
                    % {"problem": problem},
                    hint=_("Fix: %(fix)s") % {"fix": MISMATCH_FIX},
                    id="django_idempotency.E016",
                )
            )
    return messages


def _refused_in_options(alias: str) -> str | None:
    """The refused level that ``isolation_level`` in the alias' OPTIONS sets, if it does."""
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    level = connections[alias].settings_dict.get("OPTIONS", {}).get("isolation_level")
    if level in (IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE):
        return IsolationLevel(level).name.replace("_", " ").lower()
    return None


def _in_options(alias: str) -> str:
    return _("%(key)s in %(setting)s") % {
        "key": "'isolation_level'",
        "setting": f"DATABASES[{alias!r}]['OPTIONS']",
    }


def _isolation_refused(alias: str, level: str, where: str) -> Error:
    return Error(
        _(
            "Database %(alias)r, where idempotency records are stored, runs transactions at "
            "%(level)s (set by %(where)s): the claim cannot see a record committed while it "
            "waited for the key's lock, so it refuses to run, and every idempotent request "
            "and exactly-once task fails (500 misconfigured)."
        )
        % {"alias": alias, "level": level.upper(), "where": where},
        hint=_(
            "Run that database at READ COMMITTED, PostgreSQL's default: remove "
            "'isolation_level' from its OPTIONS and default_transaction_isolation from its "
            "OPTIONS['options'], and RESET default_transaction_isolation with ALTER DATABASE "
            "or ALTER ROLE; or route IdempotencyRecord to a database that runs at READ "
            "COMMITTED."
        ),
        id="django_idempotency.E007",
    )
