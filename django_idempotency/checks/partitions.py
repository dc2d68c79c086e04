"""The partitioned tables on each database (``Tags.database``: run by ``migrate`` and by
``check --database``): a partition for now (E101), enough ahead (W101), partitioned (W102), no
DEFAULT partition (W103)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.db import connections, router
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_idempotency.checks.base import ours
from django_idempotency.conf import conf, wrong_type
from django_idempotency.partitions import catalog, tables


def schedule_hint() -> str:
    return _(
        "Run `manage.py idempotency_partitions` now, and schedule it hourly: the Celery task "
        "django_idempotency.maintain_partitions (IDEMPOTENCY_BEAT_REGISTER = True with "
        "django-celery-beat), cron, or a Kubernetes CronJob."
    )


@register(Tags.database)
def check_partitions(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    # A setting of the wrong type is E013's, not a traceback here.
    if not ours(app_configs) or wrong_type("PARTITIONS_AHEAD"):
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
                _(
                    "%(table)s on database %(alias)r is not partitioned: expired rows are "
                    "removed by batched DELETEs, which write much more WAL and leave the table "
                    "bloated."
                )
                % {"table": table.table, "alias": alias},
                hint=_(
                    "The table was not created by django_idempotency's migration. Migrate "
                    "django_idempotency to zero and back (this deletes the rows)."
                ),
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
                _(
                    "No partition of %(table)s on database %(alias)r holds the current time "
                    "(%(now)s UTC): every write to it fails, and idempotent requests answer 503."
                )
                % {"table": table.table, "alias": alias, "now": f"{now:%Y-%m-%d %H:%M}"},
                hint=schedule_hint(),
                id="django_idempotency.E101",
            )
        )
    elif future < enough:
        messages.append(
            CheckWarning(
                ngettext(
                    "Only %(future)d future partition of %(table)s exists on database "
                    "%(alias)r (IDEMPOTENCY_PARTITIONS_AHEAD is %(ahead)d): partition "
                    "maintenance is not running. Writes fail (503) in %(days)d days at most.",
                    "Only %(future)d future partitions of %(table)s exist on database "
                    "%(alias)r (IDEMPOTENCY_PARTITIONS_AHEAD is %(ahead)d): partition "
                    "maintenance is not running. Writes fail (503) in %(days)d days at most.",
                    future,
                )
                % {
                    "future": future,
                    "table": table.table,
                    "alias": alias,
                    "ahead": conf.PARTITIONS_AHEAD,
                    "days": future + 1,
                },
                hint=schedule_hint(),
                id="django_idempotency.W101",
            )
        )
    if any(p.default for p in found):
        messages.append(
            CheckWarning(
                _(
                    "%(table)s on database %(alias)r has a DEFAULT partition: PostgreSQL "
                    "cannot detach partitions concurrently while it exists, so maintenance "
                    "drops none, and every new partition scans it under an exclusive lock."
                )
                % {"table": table.table, "alias": alias},
                hint=_("Move its rows out and drop it; django_idempotency never creates one."),
                id="django_idempotency.W103",
            )
        )
    return messages
