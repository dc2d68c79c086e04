"""The exactly-once chain: a relay that keeps up with the outbox (W120), dead letters to
requeue (W121), destinations it can load (E121), tasks that keep late acknowledgement (E010),
outbox backends of Django's Tasks framework that name a real backend (E122)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, router
from django.utils import timezone
from django.utils.module_loading import import_string
from django.utils.text import get_text_list
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_idempotency.checks.base import as_written, ours
from django_idempotency.conf import conf, wrong_type
from django_idempotency.messaging.outbox import leases
from django_idempotency.messaging.relay import heartbeats
from django_idempotency.models import OutboxMessage

# Dead letters are counted up to this many.
DEAD_COUNT_LIMIT = 10_000


@register(Tags.database)
def check_outbox_backlog(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Whether the outbox relay keeps up: the oldest unpublished message's age."""
    if not ours(app_configs) or wrong_type("OUTBOX_MAX_AGE") or wrong_type("OUTBOX_MAX_ATTEMPTS"):
        return []
    messages: list[CheckMessage] = []
    for alias in databases or ():
        if not router.allow_migrate_model(alias, OutboxMessage):
            continue
        try:
            oldest = leases.oldest_pending(alias)
        except DatabaseError:
            continue  # not migrated yet
        dead = leases.dead_letters(alias, DEAD_COUNT_LIMIT)
        if dead:
            messages.append(
                CheckWarning(
                    # The English reads the same for one; other languages do not.
                    ngettext(
                        "The outbox on database %(alias)r holds %(count)s dead letters: "
                        "messages that failed to publish IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS "
                        "(%(attempts)d) times and are not tried again.",
                        "The outbox on database %(alias)r holds %(count)s dead letters: "
                        "messages that failed to publish IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS "
                        "(%(attempts)d) times and are not tried again.",
                        dead,
                    )
                    % {
                        "alias": alias,
                        "count": f"{dead}{'+' if dead >= DEAD_COUNT_LIMIT else ''}",
                        "attempts": conf.OUTBOX_MAX_ATTEMPTS,
                    },
                    hint=_(
                        "Read their last error in the admin (outbox, state: dead letters), "
                        "fix its cause, then requeue them there or with `manage.py "
                        "idempotency_outbox requeue --all-dead`."
                    ),
                    id="django_idempotency.W121",
                )
            )
        if oldest is not None and timezone.now() - oldest > conf.OUTBOX_MAX_AGE:
            messages.append(
                CheckWarning(
                    _(
                        "The oldest unpublished outbox message on database %(alias)r was "
                        "written at %(oldest)s, more than IDEMPOTENCY_OUTBOX_MAX_AGE "
                        "(%(age)s) ago: %(relays)s"
                    )
                    % {
                        "alias": alias,
                        "oldest": oldest.isoformat(),
                        "age": conf.OUTBOX_MAX_AGE,
                        "relays": relays_state(alias),
                    },
                    hint=_(
                        "Run `manage.py idempotency_relay` (one or more, as long-running "
                        "processes) and read its log; rows that fail to publish show their "
                        "last error in the admin."
                    ),
                    id="django_idempotency.W120",
                )
            )
    return messages


def relays_state(alias: str) -> str:
    """What the relays' heartbeats say of why a backlog is old."""
    freshest = heartbeats.freshest(alias)
    if freshest is None or not heartbeats.alive(freshest):
        return _("no relay has beaten in the last %(seconds).0f s (none runs, or it hangs).") % {
            "seconds": heartbeats.STALE_AFTER.total_seconds()
        }
    said = {"owner": freshest.owner, "host": freshest.host, "age": heartbeats.age(freshest)}
    if freshest.last_error:
        return _(
            "relay %(owner)s on %(host)s runs (last beat %(age).0f s ago) but does not keep "
            "up, or cannot reach its destination (its last error: %(error)s)."
        ) % {**said, "error": freshest.last_error}
    return (
        _(
            "relay %(owner)s on %(host)s runs (last beat %(age).0f s ago) but does not keep "
            "up, or cannot reach its destination."
        )
        % said
    )


@register()
def check_destinations(
    app_configs: Sequence[AppConfig] | None, **kwargs: Any
) -> list[CheckMessage]:
    """The relay's destinations: each defined, its backend and client library importable,
    its options valid, every route naming one (nothing is connected to)."""
    if not ours(app_configs) or wrong_type("OUTBOX_DESTINATIONS") or wrong_type("OUTBOX_ROUTES"):
        return []
    chosen = as_written("OUTBOX_DESTINATIONS") or as_written("OUTBOX_ROUTES")
    if not chosen and importlib.util.find_spec("celery") is None:
        return []  # the default, Celery, without Celery: no relay runs here
    from django_idempotency.messaging import destinations

    try:
        destinations.configured()
    except ImproperlyConfigured as exc:
        return [
            Error(
                str(exc),
                hint=_(
                    "See docs/outbox.md, Destinations: IDEMPOTENCY_OUTBOX_DESTINATIONS maps "
                    'names to {"BACKEND": ..., "OPTIONS": {...}} and must define "default"; '
                    "IDEMPOTENCY_OUTBOX_ROUTES maps name patterns to those names."
                ),
                id="django_idempotency.E121",
            )
        ]
    return []


@register()
def check_task_backends(
    app_configs: Sequence[AppConfig] | None, **kwargs: Any
) -> list[CheckMessage]:
    """Each outbox backend of ``TASKS`` names a real backend and a Django Tasks destination."""
    tasks = getattr(settings, "TASKS", None)
    if not ours(app_configs) or not isinstance(tasks, Mapping):
        return []
    if not any(importlib.util.find_spec(name) for name in ("django.tasks", "django_tasks")):
        return []  # no Tasks framework (Django 6.0+, or the backport): TASKS is not ours
    from django_idempotency.messaging.outbox.tasks import OutboxBackend
    from django_idempotency.messaging.tasks_framework import task_backends

    errors: list[CheckMessage] = []
    for alias, spec in tasks.items():
        path = spec.get("BACKEND") if isinstance(spec, Mapping) else None
        try:
            found = import_string(path) if isinstance(path, str) else None
        except ImportError:
            continue  # the Tasks framework's own check names it
        if not (isinstance(found, type) and issubclass(found, OutboxBackend)):
            continue
        backend = task_backends[alias]
        if not isinstance(backend, OutboxBackend):
            continue
        errors += [
            Error(
                problem,
                hint=_("See docs/outbox.md, Django's Tasks framework."),
                obj=f"TASKS[{alias!r}]",
                id="django_idempotency.E122",
            )
            for problem in backend.problems()
        ]
    return errors


@register()
def check_consumers(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """Exactly-once tasks whose settings break the guarantee: without ``acks_late`` a
    message is acknowledged before it runs, so a worker that dies mid-task loses it; without
    ``reject_on_worker_lost`` Celery acknowledges a killed worker's task anyway."""
    if not ours(app_configs) or importlib.util.find_spec("celery") is None:
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

    from django_idempotency.messaging.consumers.celery import declared

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
                    _(
                        "The exactly-once task %(task)r runs with %(off)s off, so a worker "
                        "that dies while running it loses the message instead of having it "
                        "redelivered."
                    )
                    % {"task": task.name, "off": get_text_list(off, _("and"))},
                    hint=_(
                        "Remove acks_late=False / reject_on_worker_lost=False from the task's "
                        "decorator: ExactlyOnceTask turns both on."
                    ),
                    id="django_idempotency.E010",
                )
            )
    return messages
