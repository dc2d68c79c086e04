"""System checks: ``django_idempotency.E0xx`` for settings, ``W0xx`` for the environment,
``E1xx``/``W1xx`` for the partitioned tables (``Tags.database``: run by ``migrate`` and by
``check --database``)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.db import connections, router
from django.utils.module_loading import import_string

from django_idempotency import beat
from django_idempotency.conf import KINDS, conf, wrong_type
from django_idempotency.engine.errors import Misconfigured
from django_idempotency.engine.unit import server_threads
from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions import catalog, tables
from django_idempotency.problems import ERROR_FORMATS

SCHEDULE_HINT = (
    "Run `manage.py idempotency_partitions` now, and schedule it hourly: the Celery task "
    "django_idempotency.maintain_partitions (IDEMPOTENCY_BEAT_REGISTER = True with "
    "django-celery-beat), cron, or a Kubernetes CronJob."
)


# RFC 9110 token characters, less "_": WSGI servers drop header names with underscores.
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^`|~0-9A-Za-z]+")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# (setting, smallest value allowed)
DURATIONS = (
    ("TTL", timedelta.resolution),
    ("MAX_TTL", timedelta.resolution),
    ("EXPIRED_WINDOW", timedelta(0)),
    ("WAIT", timedelta(0)),
    ("MAX_WAIT", timedelta(0)),
    ("PARTITION_GRACE", timedelta(0)),
    # 0 would disable PostgreSQL's lock_timeout: DDL could then queue requests behind it.
    ("DDL_LOCK_TIMEOUT", timedelta.resolution),
    ("CONSUMER_TTL", timedelta.resolution),
    ("CONSUMER_WAIT", timedelta(0)),
    ("OUTBOX_RETENTION", timedelta.resolution),
    ("OUTBOX_POLL_INTERVAL", timedelta.resolution),
    ("OUTBOX_LEASE", timedelta.resolution),
    ("OUTBOX_MAX_AGE", timedelta.resolution),
    ("OUTBOX_REDRIVE_AFTER", timedelta.resolution),
)
# Durations that None turns off.
OPTIONAL_DURATIONS = frozenset({"OUTBOX_REDRIVE_AFTER"})
INTEGERS = (
    ("COMPRESS_MIN_BYTES", 0),
    ("MAX_RESPONSE_BYTES", 1),
    # Fewer would raise django_idempotency.W101 all the time.
    ("PARTITIONS_AHEAD", 2),
    ("DELETE_BATCH_SIZE", 1),
    ("OUTBOX_BATCH_SIZE", 1),
    ("OUTBOX_REDRIVE_LIMIT", 0),
    ("MAX_WAITERS", 0),
    ("SERVER_THREADS", 1),
)


def _ours(app_configs: Sequence[AppConfig] | None) -> bool:
    return app_configs is None or apps.get_app_config("django_idempotency") in app_configs


@register()
def check_beat(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    if not _ours(app_configs) or not conf.BEAT_REGISTER:
        return []
    messages: list[CheckMessage] = []
    if not apps.is_installed("django_celery_beat"):
        messages.append(
            CheckWarning(
                "IDEMPOTENCY_BEAT_REGISTER is True but django_celery_beat is not installed, so "
                "no periodic task runs partition maintenance.",
                hint="Install django-idempotency[celery] and add 'django_celery_beat' to "
                "INSTALLED_APPS, or set IDEMPOTENCY_BEAT_REGISTER = False and schedule "
                "`manage.py idempotency_partitions` hourly with cron or a Kubernetes CronJob.",
                id="django_idempotency.W001",
            )
        )
    try:
        beat.crontab_fields(conf.BEAT_CRONTAB)
    except ValueError as exc:
        messages.append(
            Error(
                f"IDEMPOTENCY_BEAT_CRONTAB: {exc}.",
                hint='Five fields: minute hour day-of-month month day-of-week, e.g. "17 * * * *".',
                id="django_idempotency.E001",
            )
        )
    return messages


@register(Tags.database)
def check_partitions(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    # A setting of the wrong type is E013's, not a traceback here.
    if not _ours(app_configs) or wrong_type("PARTITIONS_AHEAD"):
        return []
    messages: list[CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        for table in tables.registered():
            model = table.model_class()
            if model is None or router.allow_migrate_model(alias, model):
                messages += _check_table(alias, table)
    return messages


def _check_table(alias: str, table: tables.PartitionedTable) -> list[CheckMessage]:
    connection = connections[alias]
    kind = catalog.table_kind(connection, table)
    if kind is None:
        return []  # not migrated yet
    if kind == "plain":
        return [
            CheckWarning(
                f"{table.table} on database {alias!r} is not partitioned: expired rows are "
                "removed by batched DELETEs, which write much more WAL and leave the table "
                "bloated.",
                hint="The table was not created by django_idempotency's migration. Migrate "
                "django_idempotency to zero and back (this deletes the rows).",
                id="django_idempotency.W102",
            )
        ]
    messages: list[CheckMessage] = []
    found = catalog.list_partitions(connection, table)
    now = catalog.database_now(connection)
    future = len(catalog.future_partitions(found, now))
    # A day short of the configured headroom means at least one day's runs failed or never
    # ran: said days before the last partition is used up, not on the day.
    enough = max(2, conf.PARTITIONS_AHEAD - 1)
    if not catalog.holds(found, now):
        messages.append(
            Error(
                f"No partition of {table.table} on database {alias!r} holds the current "
                f"time ({now:%Y-%m-%d %H:%M} UTC): every write to it fails, and idempotent "
                "requests answer 503.",
                hint=SCHEDULE_HINT,
                id="django_idempotency.E101",
            )
        )
    elif future < enough:
        messages.append(
            CheckWarning(
                f"Only {future} future partitions of {table.table} exist on database "
                f"{alias!r} (IDEMPOTENCY_PARTITIONS_AHEAD is {conf.PARTITIONS_AHEAD}): "
                f"partition maintenance is not running. Writes fail (503) in {future + 1} "
                "days at most.",
                hint=SCHEDULE_HINT,
                id="django_idempotency.W101",
            )
        )
    if any(p.default for p in found):
        messages.append(
            CheckWarning(
                f"{table.table} on database {alias!r} has a DEFAULT partition: PostgreSQL "
                "cannot detach partitions concurrently while it exists, so maintenance drops "
                "none, and every new partition scans it under an exclusive lock.",
                hint="Move its rows out and drop it; django_idempotency never creates one.",
                id="django_idempotency.W103",
            )
        )
    return messages


def _as_written(name: str) -> Any:
    # conf normalises some values (upper-cased methods, int()); a check must see them as
    # the user wrote them.
    return getattr(settings, f"IDEMPOTENCY_{name}", None)


@register()
def check_settings(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    if not _ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    # One error per setting of the wrong type; the checks below judge the others' values.
    problems = {name: problem for name in KINDS if (problem := wrong_type(name))}
    celery_app = _as_written("OUTBOX_CELERY_APP")
    if celery_app and not problems.get("OUTBOX_CELERY_APP"):
        try:
            import_string(celery_app)
        except ImportError as exc:
            problems["OUTBOX_CELERY_APP"] = (
                f"IDEMPOTENCY_OUTBOX_CELERY_APP {celery_app!r} cannot be imported ({exc})."
            )
    for name, problem in problems.items():
        messages.append(
            Error(
                problem,
                hint=f"Give IDEMPOTENCY_{name} {KINDS[name].description}, or remove it to use "
                "its default.",
                id="django_idempotency.E013",
            )
        )
    invalid = set(problems)
    header = conf.HEADER
    if "HEADER" not in invalid and not HEADER_NAME.fullmatch(header):
        messages.append(
            Error(
                f"IDEMPOTENCY_HEADER {header!r} is not an HTTP header name.",
                hint="Use letters, digits and hyphens, such as the default 'Idempotency-Key'. "
                "Underscores are out: web servers drop headers whose name has one.",
                id="django_idempotency.E002",
            )
        )
    for name, least in DURATIONS:
        value = getattr(conf, name)
        if name in invalid or (value is None and name in OPTIONAL_DURATIONS):
            continue
        if value < least:
            invalid.add(name)
            wanted = "a positive timedelta" if least else "a timedelta, zero or more"
            if name in OPTIONAL_DURATIONS:
                wanted += ", or None"
            messages.append(
                Error(
                    f"IDEMPOTENCY_{name} is {value!r}; it must be {wanted}.",
                    hint=f"Set IDEMPOTENCY_{name} to a datetime.timedelta, or remove it to "
                    "use its default.",
                    id="django_idempotency.E003",
                )
            )
    for default, maximum in (("TTL", "MAX_TTL"), ("WAIT", "MAX_WAIT")):
        low, high = getattr(conf, default), getattr(conf, maximum)
        if not invalid & {default, maximum} and low > high:
            messages.append(
                Error(
                    f"IDEMPOTENCY_{default} ({low}) is longer than IDEMPOTENCY_{maximum} "
                    f"({high}), which caps it.",
                    hint=f"Lower IDEMPOTENCY_{default} or raise IDEMPOTENCY_{maximum}.",
                    id="django_idempotency.E004",
                )
            )
    if "ERROR_FORMAT" not in invalid and conf.ERROR_FORMAT not in ERROR_FORMATS:
        messages.append(
            Error(
                f"IDEMPOTENCY_ERROR_FORMAT {conf.ERROR_FORMAT!r} is not a known error format.",
                hint='Use "problem" (RFC 9457 problem details, the default) or "stripe".',
                id="django_idempotency.E005",
            )
        )
    methods = _as_written("METHODS")
    if methods is not None and "METHODS" not in invalid:
        safe = ", ".join(sorted(SAFE_METHODS & {m.upper() for m in methods}))
        if safe:
            messages.append(
                Error(
                    f"IDEMPOTENCY_METHODS {methods!r}: {safe}.",
                    hint='List unsafe methods only, such as ["POST", "PATCH"]: safe methods '
                    "change nothing, so they need no key and their answers must stay fresh.",
                    id="django_idempotency.E006",
                )
            )
    for name, smallest in INTEGERS:
        number = _as_written(name)
        if number is not None and name not in invalid and number < smallest:
            messages.append(
                Error(
                    f"IDEMPOTENCY_{name} is {number!r}; it must be an integer of at least "
                    f"{smallest}.",
                    hint=f"Remove IDEMPOTENCY_{name} to use its default.",
                    id="django_idempotency.E008",
                )
            )
    principal = _as_written("PRINCIPAL")
    if principal is not None and "PRINCIPAL" not in invalid:
        try:
            func = conf.PRINCIPAL
        except ImportError as exc:
            problem = f"cannot be imported ({exc})"
        else:
            problem = "" if callable(func) else "is not callable"
        if problem:
            messages.append(
                Error(
                    f"IDEMPOTENCY_PRINCIPAL {principal!r} {problem}.",
                    hint="Give a function taking the request and returning a string, or its "
                    'dotted path, such as "myproject.api.tenant_of".',
                    id="django_idempotency.E009",
                )
            )
    display = _as_written("PRINCIPAL_DISPLAY")
    if display is not None and "PRINCIPAL_DISPLAY" not in invalid:
        # Found only when the admin's records page fails, without this check.
        try:
            labels = conf.PRINCIPAL_DISPLAY
        except ImportError as exc:
            problem = f"cannot be imported ({exc})"
        else:
            problem = "" if callable(labels) else "is not callable"
        if problem:
            messages.append(
                Error(
                    f"IDEMPOTENCY_PRINCIPAL_DISPLAY {display!r} {problem}.",
                    hint="Give a function taking a list of principals and returning a dict "
                    "from principal to label, or its dotted path, or remove the setting.",
                    id="django_idempotency.E011",
                )
            )
    return messages


@register()
def check_servers(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """What the server shape asks of waiting duplicates and of database connections."""
    if not _ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    cap = _as_written("MAX_WAITERS")
    threads, source = (None, "") if _invalid_integer("SERVER_THREADS") else server_threads()
    if isinstance(cap, int) and cap > 0 and threads is not None and cap >= threads:
        messages.append(
            CheckWarning(
                f"IDEMPOTENCY_MAX_WAITERS is {cap}, but a server process has {threads} "
                f"request thread(s) ({source}): waiting duplicates could hold every thread, "
                "and other requests would wait behind them.",
                hint=f"Set IDEMPOTENCY_MAX_WAITERS to {max(threads - 1, 0)} or fewer (leave "
                "a thread for each slow request you expect at once), or to 0 so that "
                "duplicates get 409 at once.",
                id="django_idempotency.W008",
            )
        )
    if getattr(settings, "ASGI_APPLICATION", None):
        for alias in connections:
            database = connections[alias].settings_dict
            age = database.get("CONN_MAX_AGE", 0)
            if age != 0 and not database.get("OPTIONS", {}).get("pool"):
                messages.append(
                    CheckWarning(
                        f"Database {alias!r} keeps connections open (CONN_MAX_AGE = {age!r}) "
                        "and the project runs under ASGI (ASGI_APPLICATION is set): Django "
                        "opens a connection in each request's thread there, so connections "
                        "pile up until the database refuses new clients.",
                        hint=f"Use Django's connection pool (DATABASES[{alias!r}]['OPTIONS']"
                        "['pool'] = {'max_size': ...} with CONN_MAX_AGE = 0; install "
                        "psycopg[pool]), or set CONN_MAX_AGE = 0.",
                        id="django_idempotency.W009",
                    )
                )
    return messages


def _invalid_integer(name: str) -> bool:
    value = _as_written(name)
    return value is not None and (not isinstance(value, int) or isinstance(value, bool))


@register()
def check_databases(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """What the DATABASES setting means for the records' database; no query is made."""
    if not _ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    alias = router.db_for_write(IdempotencyRecord)
    connection = connections[alias]
    if connection.vendor != "postgresql":
        messages.append(
            CheckWarning(
                f"Idempotency records are stored on {connection.display_name} (database "
                f"{alias!r}) in a plain table: expired records leave by batched DELETEs and a "
                "duplicate request gets 409 at once instead of waiting for the replay.",
                hint="This fallback is meant for development; use PostgreSQL in production.",
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
                    f"ATOMIC_REQUESTS is on for database {other!r}, but idempotency records "
                    f"are stored on {alias!r}: the record commits before the request's "
                    f"transaction on {other!r} does, so if that commit fails, retries replay a "
                    "response whose writes never happened.",
                    hint="Route IdempotencyRecord to the database your idempotent views write "
                    "to; only writes to that database commit together with the record.",
                    id="django_idempotency.W002",
                )
            )
    return messages


# The levels whose snapshot is taken before the claim holds the key's lock (migration 0007).
REFUSED_LEVELS = frozenset({"repeatable read", "serializable"})
# pg_settings.source of default_transaction_isolation: where a level that DATABASES does not
# show was set.
LEVEL_SOURCES = {
    "database": "ALTER DATABASE ... SET default_transaction_isolation",
    "user": "ALTER ROLE ... SET default_transaction_isolation",
    "database user": "ALTER ROLE ... IN DATABASE ... SET default_transaction_isolation",
    "client": "the connection's options (OPTIONS['options'] or PGOPTIONS)",
    "session": "SET default_transaction_isolation on the connection",
    "configuration file": "postgresql.conf",
}


def _refused_in_options(alias: str) -> str | None:
    """The refused level that ``isolation_level`` in the alias' OPTIONS sets, if it does."""
    from django.db.backends.postgresql.psycopg_any import IsolationLevel

    level = connections[alias].settings_dict.get("OPTIONS", {}).get("isolation_level")
    if level in (IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE):
        return IsolationLevel(level).name.replace("_", " ").lower()
    return None


def _in_options(alias: str) -> str:
    return f"'isolation_level' in DATABASES[{alias!r}]['OPTIONS']"


def _isolation_refused(alias: str, level: str, where: str) -> Error:
    return Error(
        f"Database {alias!r}, where idempotency records are stored, runs transactions at "
        f"{level.upper()} (set by {where}): the claim cannot see a record committed while it "
        "waited for the key's lock, so it refuses to run, and every idempotent request and "
        "exactly-once task fails (500 misconfigured).",
        hint="Run that database at READ COMMITTED, PostgreSQL's default: remove "
        "'isolation_level' from its OPTIONS and default_transaction_isolation from its "
        "OPTIONS['options'], and RESET default_transaction_isolation with ALTER DATABASE or "
        "ALTER ROLE; or route IdempotencyRecord to a database that runs at READ COMMITTED.",
        id="django_idempotency.E007",
    )


@register(Tags.database)
def check_isolation(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """The isolation level a transaction on each records' database actually gets, wherever
    it was set (check_databases sees only OPTIONS, without a query)."""
    from django.db import DatabaseError, transaction

    if not _ours(app_configs):
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
            where = _in_options(alias) if in_options else LEVEL_SOURCES.get(source, source)
            messages.append(_isolation_refused(alias, level, where))
    return messages


@register(Tags.database)
def check_outbox_backlog(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Whether the outbox relay keeps up: the oldest unpublished message's age."""
    from django.db import DatabaseError
    from django.db.models import Min
    from django.utils import timezone

    from django_idempotency.models import OutboxMessage

    if not _ours(app_configs) or wrong_type("OUTBOX_MAX_AGE"):
        return []
    messages: list[CheckMessage] = []
    for alias in databases or ():
        if not router.allow_migrate_model(alias, OutboxMessage):
            continue
        pending = OutboxMessage.objects.using(alias).filter(published_at__isnull=True)
        try:
            oldest = pending.aggregate(oldest=Min("created_at"))["oldest"]
        except DatabaseError:
            continue  # not migrated yet
        if oldest is not None and timezone.now() - oldest > conf.OUTBOX_MAX_AGE:
            messages.append(
                CheckWarning(
                    f"The oldest unpublished outbox message on database {alias!r} was written "
                    f"at {oldest.isoformat()}, more than IDEMPOTENCY_OUTBOX_MAX_AGE "
                    f"({conf.OUTBOX_MAX_AGE}) ago: no relay is running, or it cannot reach "
                    "the broker.",
                    hint="Run `manage.py idempotency_relay` (one or more, as long-running "
                    "processes) and read its log; rows that fail to publish show their last "
                    "error in the admin.",
                    id="django_idempotency.W120",
                )
            )
    return messages


@register()
def check_consumers(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """Exactly-once tasks whose settings break the guarantee: without ``acks_late`` a
    message is acknowledged before it runs, so a worker that dies mid-task loses it; without
    ``reject_on_worker_lost`` Celery acknowledges a killed worker's task anyway."""
    import contextlib
    import importlib
    import importlib.util

    if not _ours(app_configs) or importlib.util.find_spec("celery") is None:
        return []
    # Tasks are declared at import: import each app's tasks module, as Celery's
    # autodiscovery does, so that the check sees the tasks a worker would run.
    for config in apps.get_app_configs():
        try:
            found = importlib.util.find_spec(f"{config.name}.tasks")
        except ImportError:
            found = None
        if found is not None:
            importlib.import_module(f"{config.name}.tasks")
    from celery import current_app

    from django_idempotency.messaging.consumers import declared

    # A shared task's class is made when an app is finalized; an app that finalizes only by
    # hand (autofinalize=False) is left alone.
    with contextlib.suppress(RuntimeError):
        current_app.finalize(auto=True)
    messages: list[CheckMessage] = []
    for task in declared:
        off = [name for name in ("acks_late", "reject_on_worker_lost") if not getattr(task, name)]
        if off and getattr(task, "name", None):
            messages.append(
                Error(
                    f"The exactly-once task {task.name!r} runs with {' and '.join(off)} off, so "
                    "a worker that dies while running it loses the message instead of "
                    "having it redelivered.",
                    hint="Remove acks_late=False / reject_on_worker_lost=False from the task's "
                    "decorator: ExactlyOnceTask turns both on.",
                    id="django_idempotency.E010",
                )
            )
    return messages


@register(Tags.urls)
def check_views(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """What each idempotent view of the URLconf risks: a shared anonymous scope, a durable
    block that cannot run in the claim's transaction."""
    # Like Django's own URL checks: no URLconf, nothing to judge.
    if not _ours(app_configs) or not getattr(settings, "ROOT_URLCONF", None):
        return []
    messages: list[CheckMessage] = []
    for endpoint in _endpoints():
        name = f"{endpoint.route} ({_qualname(endpoint.handler)})"
        policy = endpoint.policy
        if _claims_before_authentication(endpoint):
            messages.append(
                Error(
                    f"The idempotent view {name} is decorated with @idempotent outside the "
                    "view's own dispatch (above @api_view, around as_view(), or on "
                    "dispatch()), so the key is claimed before the view authenticates the "
                    "client: every caller shares the anonymous principal.",
                    hint="Put @idempotent below @api_view (next to the function), use "
                    "IdempotencyMixin on a DRF class view, or decorate the method handler "
                    '(method_decorator(idempotent, name="post")).',
                    id="django_idempotency.E014",
                )
            )
        elif (
            policy.principal is None
            and not policy.allow_anonymous
            and _open_to_anonymous(endpoint.view)
        ):
            messages.append(
                CheckWarning(
                    f"The idempotent view {name} lets anonymous clients in, and all of them "
                    "share one principal: one anonymous client's key can replay another's "
                    "response.",
                    hint="Require authentication on this view, or give it a principal "
                    "callable (idempotency_principal / principal=) that tells anonymous "
                    "clients apart, such as by an API client id; or, where shared anonymous "
                    "keys are meant, set allow_anonymous=True.",
                    id="django_idempotency.W004",
                )
            )
        if _opens_durable_block(endpoint.handler):
            messages.append(
                CheckWarning(
                    f"The idempotent view {name} opens transaction.atomic(durable=True), which "
                    "cannot run inside the transaction that holds its key: such requests fail "
                    "with a clear error instead of running.",
                    hint="Use a plain transaction.atomic() in an idempotent view.",
                    id="django_idempotency.W005",
                )
            )
    return messages


def _endpoints() -> list[Any]:
    from django_idempotency.endpoints import idempotent_endpoints

    try:
        return idempotent_endpoints()
    except Misconfigured:  # a setting of the wrong type: E013 says which
        return []


def _qualname(handler: Any) -> str:
    target = inspect.unwrap(handler) if callable(handler) else handler
    if not hasattr(target, "__qualname__"):
        target = type(target)
    return f"{target.__module__}.{target.__qualname__}"


def _claims_before_authentication(endpoint: Any) -> bool:
    """``@idempotent`` around the whole dispatch of a class view that authenticates there
    (DRF's, or one with Django's access mixins): on the function that ``@api_view`` or
    ``as_view()`` returned, or on ``dispatch()`` (which ``as_view()`` copies from)."""
    handler = endpoint.handler
    view_class = getattr(handler, "cls", None) or getattr(handler, "view_class", None)
    if view_class is None or getattr(handler, "idempotency_options", None) is None:
        return False
    from django.contrib.auth.mixins import AccessMixin

    return hasattr(view_class, "permission_classes") or issubclass(view_class, AccessMixin)


def _open_to_anonymous(view: Any) -> bool:
    """A DRF view (a class, or ``@api_view``'s) whose permissions all allow anonymous
    clients, or a Ninja operation without ``auth``; plain views cannot be judged from
    outside (their decorators decide)."""
    if hasattr(view, "auth_callbacks") and hasattr(view, "view_func"):  # Ninja's operation
        return not view.auth_callbacks
    permissions = getattr(view, "permission_classes", None)
    if permissions is None:
        return False
    from rest_framework.permissions import AllowAny

    return all(permission is AllowAny for permission in permissions)


def _opens_durable_block(handler: Any) -> bool:
    try:
        source = inspect.getsource(inspect.unwrap(handler))
    except (OSError, TypeError):
        return False
    return re.search(r"atomic\([^)]*durable\s*=\s*True", source) is not None


@register(Tags.database)
def check_records_follow_writes(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """A generic view's records go to the database of its model's writes: the records'
    table must be migrated there, or every request of that view fails."""
    if not _ours(app_configs) or not databases or not getattr(settings, "ROOT_URLCONF", None):
        return []
    try:
        from django_idempotency.rest_framework import written_model
    except ImportError:  # without DRF, no view has a model to follow
        return []
    messages: list[CheckMessage] = []
    for endpoint in _endpoints():
        model = written_model(endpoint.view) if endpoint.policy.using is None else None
        if model is None:
            continue
        alias = router.db_for_write(model)
        if alias in databases and not router.allow_migrate_model(alias, IdempotencyRecord):
            messages.append(
                Error(
                    f"The idempotent view {endpoint.route} writes {model._meta.label} to "
                    f"database {alias!r}, where its records must live to commit with those "
                    "writes, but the routers do not migrate IdempotencyRecord there.",
                    hint=f"Let allow_migrate() accept django_idempotency on {alias!r} and "
                    "migrate it, or give the view idempotency_using.",
                    id="django_idempotency.E012",
                )
            )
    return messages
