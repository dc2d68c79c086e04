"""The IDEMPOTENCY_* settings as written: types (E013), header (E002), durations (E003, E004),
error format (E005), methods (E006), integers (E008), paths (E009, E011), beat (W001, E001)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.apps import AppConfig, apps
from django.core.checks import CheckMessage, Error, register
from django.core.checks import Warning as CheckWarning
from django.utils.module_loading import import_string

from django_idempotency import beat
from django_idempotency.checks.base import as_written, ours
from django_idempotency.conf import KINDS, conf, wrong_type
from django_idempotency.http.problems import ERROR_FORMATS

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
    ("CDC_RETENTION", timedelta.resolution),
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


@register()
def check_settings(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    if not ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    # One error per setting of the wrong type; the checks below judge the others' values.
    problems = {name: problem for name in KINDS if (problem := wrong_type(name))}
    celery_app = as_written("OUTBOX_CELERY_APP")
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
    methods = as_written("METHODS")
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
        number = as_written(name)
        if number is not None and name not in invalid and number < smallest:
            messages.append(
                Error(
                    f"IDEMPOTENCY_{name} is {number!r}; it must be an integer of at least "
                    f"{smallest}.",
                    hint=f"Remove IDEMPOTENCY_{name} to use its default.",
                    id="django_idempotency.E008",
                )
            )
    messages += _function_setting(
        "PRINCIPAL",
        invalid,
        hint="Give a function taking the request and returning a string, or its dotted path, "
        'such as "myproject.api.tenant_of".',
        id="django_idempotency.E009",
    )
    # Found only when the admin's records page fails, without this check.
    messages += _function_setting(
        "PRINCIPAL_DISPLAY",
        invalid,
        hint="Give a function taking a list of principals and returning a dict from principal "
        "to label, or its dotted path, or remove the setting.",
        id="django_idempotency.E011",
    )
    return messages


def _function_setting(name: str, invalid: set[str], *, hint: str, id: str) -> list[CheckMessage]:
    """A setting that names a function: it must import, and be callable."""
    written = as_written(name)
    if written is None or name in invalid:
        return []
    try:
        func = getattr(conf, name)
    except ImportError as exc:
        problem = f"cannot be imported ({exc})"
    else:
        problem = "" if callable(func) else "is not callable"
    if not problem:
        return []
    return [Error(f"IDEMPOTENCY_{name} {written!r} {problem}.", hint=hint, id=id)]


@register()
def check_beat(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    if not ours(app_configs) or not conf.BEAT_REGISTER:
        return []
    messages: list[CheckMessage] = []
    if not apps.is_installed("django_celery_beat"):
        messages.append(
            CheckWarning(
                "IDEMPOTENCY_BEAT_REGISTER is True but django_celery_beat is not installed, so "
                "no periodic task runs partition maintenance.",
                hint="Install django-idempotency[beat] and add 'django_celery_beat' to "
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
