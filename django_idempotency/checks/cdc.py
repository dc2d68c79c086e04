"""Change data capture, where ``IDEMPOTENCY_CDC_PUBLICATION`` names a publication
(``Tags.database``): it exists (W130), publishes the event table's inserts through its root
(W131), and the server decodes its log (W132)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Tags, register
from django.core.checks import Warning as CheckWarning
from django.db import DatabaseError, connections, router
from django.utils.translation import gettext as _

from django_idempotency.checks.base import ours
from django_idempotency.conf import conf, wrong_type
from django_idempotency.messaging.cdc import publication
from django_idempotency.models import OutboxEvent


def command_hint() -> str:
    return _(
        "Run `manage.py idempotency_cdc publication` as the event table's owner, or hand the "
        "SQL that `manage.py idempotency_cdc publication --sql` prints to your DBA."
    )


@register(Tags.database)
def check_cdc(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    if not ours(app_configs) or wrong_type("CDC_PUBLICATION") or not conf.CDC_PUBLICATION:
        return []
    messages: list[CheckMessage] = []
    for alias in databases or ():
        if connections[alias].vendor != "postgresql":
            continue
        if not router.allow_migrate_model(alias, OutboxEvent):
            continue
        try:
            found = publication.state(alias, conf.CDC_PUBLICATION)
        except DatabaseError:
            continue  # not migrated yet, or no server
        messages += _messages(alias, found)
    return messages


def _messages(alias: str, found: publication.State) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    if not found.decodes:
        messages.append(
            CheckWarning(
                _(
                    "Database %(alias)r runs with wal_level = %(level)r: no logical "
                    "replication slot can read the event table's rows from its log."
                )
                % {"alias": alias, "level": found.wal_level},
                hint=_(
                    "Set wal_level = logical in postgresql.conf (or the managed service's "
                    "logical replication flag) and restart the server."
                ),
                id="django_idempotency.W132",
            )
        )
    if not found.exists:
        messages.append(
            CheckWarning(
                _(
                    "The publication %(publication)r (IDEMPOTENCY_CDC_PUBLICATION) does not "
                    "exist on database %(alias)r: a connector reading it sees no events."
                )
                % {"publication": found.publication, "alias": alias},
                hint=command_hint(),
                id="django_idempotency.W130",
            )
        )
        return messages
    wrong = found.problems()
    if wrong:
        messages.append(
            CheckWarning(
                _(
                    "On database %(alias)r: %(problems)s. Debezium would miss the events or "
                    "see each day's partition as its own table."
                )
                % {"alias": alias, "problems": "; ".join(wrong)},
                hint=command_hint(),
                id="django_idempotency.W131",
            )
        )
    return messages
