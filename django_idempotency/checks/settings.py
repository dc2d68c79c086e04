"""The IDEMPOTENCY_* settings as written: types (E013), header (E002), durations (E003, E004),
error format (E005), methods (E006), integers (E008), paths (E009, E011), beat (W001, E001),
unknown names (W020), values outside their allowed set (E020), waiting that cannot (W022).

Over 400 lines as one concern, the settings as written: one check per setting, each with the
hint that names its fix."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, register
from django.core.checks import Warning as CheckWarning
from django.utils.module_loading import import_string
from django.utils.translation import gettext as _

from django_idempotency import beat
from django_idempotency.checks.base import as_written, ours
from django_idempotency.conf import KINDS, conf, wrong_type
from django_idempotency.engine.waiting import server_threads
from django_idempotency.http.problems import ERROR_FORMATS
from django_idempotency.storage import bodies

# RFC 9110 token characters, less "_": WSGI servers drop header names with underscores.
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^`|~0-9A-Za-z]+")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# The unsafe methods of RFC 9110 and RFC 5789 that a Django view can be asked for (CONNECT
# never reaches one).
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# The statuses a view's response can have that IDEMPOTENCY_UNSTORED_STATUSES may list: a
# 1xx-3xx there would roll back every success of that status, and anything else never matches.
UNSTORED_RANGE = range(400, 600)
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
            problems["OUTBOX_CELERY_APP"] = _(
                "IDEMPOTENCY_OUTBOX_CELERY_APP %(path)r cannot be imported (%(error)s)."
            ) % {"path": celery_app, "error": exc}
    for name, problem in problems.items():
        messages.append(
            Error(
                problem,
                hint=_("Give IDEMPOTENCY_%(name)s %(kind)s, or remove it to use its default.")
                % {"name": name, "kind": KINDS[name].description},
                id="django_idempotency.E013",
            )
        )
    invalid = set(problems)
    header = conf.HEADER
    if "HEADER" not in invalid and not HEADER_NAME.fullmatch(header):
        messages.append(
            Error(
                _("IDEMPOTENCY_HEADER %(header)r is not an HTTP header name.") % {"header": header},
                hint=_(
                    "Use letters, digits and hyphens, such as the default 'Idempotency-Key'. "
                    "Underscores are out: web servers drop headers whose name has one."
                ),
                id="django_idempotency.E002",
            )
        )
    for name, least in DURATIONS:
        value = getattr(conf, name)
        if name in invalid or (value is None and name in OPTIONAL_DURATIONS):
            continue
        if value < least:
            invalid.add(name)
            wanted = _("a positive timedelta") if least else _("a timedelta, zero or more")
            if name in OPTIONAL_DURATIONS:
                wanted = _("%(kind)s, or None") % {"kind": wanted}
            messages.append(
                Error(
                    _("IDEMPOTENCY_%(name)s is %(value)r; it must be %(wanted)s.")
                    % {"name": name, "value": value, "wanted": wanted},
                    hint=_(
                        "Set IDEMPOTENCY_%(name)s to a datetime.timedelta, or remove it to use "
                        "its default."
                    )
                    % {"name": name},
                    id="django_idempotency.E003",
                )
            )
    for default, maximum in (("TTL", "MAX_TTL"), ("WAIT", "MAX_WAIT")):
        low, high = getattr(conf, default), getattr(conf, maximum)
        if not invalid & {default, maximum} and low > high:
            messages.append(
                Error(
                    _(
                        "IDEMPOTENCY_%(default)s (%(low)s) is longer than "
                        "IDEMPOTENCY_%(maximum)s (%(high)s), which caps it."
                    )
                    % {"default": default, "low": low, "maximum": maximum, "high": high},
                    hint=_("Lower IDEMPOTENCY_%(default)s or raise IDEMPOTENCY_%(maximum)s.")
                    % {"default": default, "maximum": maximum},
                    id="django_idempotency.E004",
                )
            )
    error_format = as_written("ERROR_FORMAT")
    if "ERROR_FORMAT" not in invalid and error_format is not None:
        if isinstance(error_format, str) and "." not in error_format:
            wrong = None if error_format in ERROR_FORMATS else _("is not a known error format")
        else:
            wrong = _not_a_function("ERROR_FORMAT")
        if wrong:
            messages.append(
                Error(
                    _("IDEMPOTENCY_ERROR_FORMAT %(value)r %(wrong)s.")
                    % {"value": error_format, "wrong": wrong},
                    hint=_(
                        'Use "problem" (RFC 9457 problem details, the default), "stripe", or '
                        "the dotted path of a function that takes the error and returns the "
                        'JSON body of its response ("myproject.errors.idempotency_error"). In '
                        "DRF views, IDEMPOTENCY_DRF_EXCEPTION_HANDLER = True hands the errors "
                        "to REST_FRAMEWORK's EXCEPTION_HANDLER instead."
                    ),
                    id="django_idempotency.E005",
                )
            )
    methods = as_written("METHODS")
    if methods is not None and "METHODS" not in invalid:
        safe = ", ".join(sorted(SAFE_METHODS & {m.upper() for m in methods}))
        if safe:
            messages.append(
                Error(
                    _("IDEMPOTENCY_METHODS %(methods)r: %(safe)s.")
                    % {"methods": methods, "safe": safe},
                    hint=_(
                        'List unsafe methods only, such as ["POST", "PATCH"]: safe methods '
                        "change nothing, so they need no key and their answers must stay fresh."
                    ),
                    id="django_idempotency.E006",
                )
            )
    for name, smallest in INTEGERS:
        number = as_written(name)
        if number is not None and name not in invalid and number < smallest:
            messages.append(
                Error(
                    _(
                        "IDEMPOTENCY_%(name)s is %(value)r; it must be an integer of at least "
                        "%(least)d."
                    )
                    % {"name": name, "value": number, "least": smallest},
                    hint=_("Remove IDEMPOTENCY_%(name)s to use its default.") % {"name": name},
                    id="django_idempotency.E008",
                )
            )
    messages += _unknown_settings()
    messages += _outside_allowed_sets(invalid)
    messages += _waiting_that_cannot_wait(invalid)
    messages += _function_setting(
        "PRINCIPAL",
        invalid,
        hint=_(
            "Give a function taking the request and returning a string, or its dotted path, "
            'such as "myproject.api.tenant_of".'
        ),
        id="django_idempotency.E009",
    )
    # Found only when the admin's records page fails, without this check.
    messages += _function_setting(
        "PRINCIPAL_DISPLAY",
        invalid,
        hint=_(
            "Give a function taking a list of principals and returning a dict from principal "
            "to label, or its dotted path, or remove the setting."
        ),
        id="django_idempotency.E011",
    )
    return messages


def _unknown_settings() -> list[CheckMessage]:
    """An ``IDEMPOTENCY_*`` setting the app does not read: most likely a misspelling, which
    would otherwise leave the setting it meant at its default without a word."""
    messages: list[CheckMessage] = []
    for name in sorted(n for n in dir(settings) if n.startswith("IDEMPOTENCY_")):
        suffix = name.removeprefix("IDEMPOTENCY_")
        if suffix in KINDS:
            continue
        # Without the prefix every name shares, which would make anything look close.
        nearest = [f"IDEMPOTENCY_{n}" for n in difflib.get_close_matches(suffix, KINDS, n=1)]
        said = {"name": name, "nearest": nearest[0] if nearest else ""}
        messages.append(
            CheckWarning(
                (
                    _(
                        "%(name)s is not a setting of django-idempotency, so it has no "
                        "effect. Did you mean %(nearest)s?"
                    )
                    if nearest
                    else _("%(name)s is not a setting of django-idempotency, so it has no effect.")
                )
                % said,
                hint=(
                    _(
                        "Rename it to %(nearest)s, or remove it (the settings: "
                        "docs/settings.md; another package's: docs/migrating.md)."
                    )
                    if nearest
                    else _(
                        "Remove it (the settings: docs/settings.md; another package's: "
                        "docs/migrating.md)."
                    )
                )
                % said,
                id="django_idempotency.W020",
            )
        )
    return messages


def _outside_allowed_sets(invalid: set[str]) -> list[CheckMessage]:
    """Values of the right type that no request can mean: an unknown method, a status no
    response has (or a success, whose every answer would be rolled back), a header name no
    request or response can carry."""
    problems: list[tuple[str, str, str]] = []
    methods = as_written("METHODS")
    if methods is not None and "METHODS" not in invalid:
        unknown = [m for m in methods if m.upper() not in SAFE_METHODS | UNSAFE_METHODS]
        if unknown:
            problems.append(
                (
                    "METHODS",
                    _("%(values)r: not an HTTP method a view can be asked for")
                    % {"values": unknown},
                    _('List unsafe methods only, among "POST", "PUT", "PATCH" and "DELETE".'),
                )
            )
    statuses = as_written("UNSTORED_STATUSES")
    if statuses is not None and "UNSTORED_STATUSES" not in invalid:
        outside = [s for s in statuses if s not in UNSTORED_RANGE]
        if outside:
            problems.append(
                (
                    "UNSTORED_STATUSES",
                    _("%(values)r: not a 4xx or 5xx status") % {"values": outside},
                    _(
                        "List 4xx statuses that mean 'try again' (the default: 408, 409, 425, "
                        "429); a success listed here would roll back every answer of that "
                        "status."
                    ),
                )
            )
    for name in ("FINGERPRINT_HEADERS", "REPLAY_HEADERS"):
        headers = as_written(name)
        if headers is None or name in invalid:
            continue
        bad = [h for h in headers if not HEADER_NAME.fullmatch(h)]
        if bad:
            problems.append(
                (
                    name,
                    _("%(values)r: not an HTTP header name") % {"values": bad},
                    _(
                        'Use header names as sent, letters, digits and hyphens ("X-Account"); '
                        "web servers drop names with an underscore."
                    ),
                )
            )
    codec = as_written("BODY_COMPRESSION")
    if codec is not None and "BODY_COMPRESSION" not in invalid:
        if codec not in (bodies.ZLIB, bodies.ZSTD):
            problems.append(
                (
                    "BODY_COMPRESSION",
                    _("%(value)r is not a compression the records can be stored with")
                    % {"value": codec},
                    _('Use "zstd" or "zlib", or remove it: zstd where it is installed, else zlib.'),
                )
            )
        elif codec == bodies.ZSTD and bodies.zstd_codec() is None:
            problems.append(
                (
                    "BODY_COMPRESSION",
                    _("'zstd' names zstd, which this Python cannot import"),
                    _(
                        "Install django-idempotency[zstd] (the zstandard package; Python 3.14 "
                        'has compression.zstd), or set it to "zlib".'
                    ),
                )
            )
    return [
        Error(
            _("IDEMPOTENCY_%(name)s %(said)s.") % {"name": name, "said": said},
            hint=hint,
            id="django_idempotency.E020",
        )
        for name, said, hint in problems
    ]


def _waiting_that_cannot_wait(invalid: set[str]) -> list[CheckMessage]:
    """IDEMPOTENCY_WAIT set where no sync request may wait: waiting on a thread is opt-in
    twice (IDEMPOTENCY_MAX_WAITERS), and a server of one thread per process never waits."""
    wait = as_written("WAIT")
    if (
        not isinstance(wait, timedelta)
        or wait <= timedelta(0)
        or invalid & {"WAIT", "MAX_WAITERS", "SERVER_THREADS"}
    ):
        return []
    cap = conf.MAX_WAITERS
    threads, source = server_threads()
    if cap > 0:
        if threads != 1:
            return []
        why = _("a server process has one request thread (%(source)s), which never waits") % {
            "source": source
        }
    elif getattr(settings, "ASGI_APPLICATION", None):
        return []  # async views under ASGI wait without a cap: waiting works there
    else:
        why = _("IDEMPOTENCY_MAX_WAITERS is 0 (its default), so no sync view waits")
    return [
        CheckWarning(
            _("IDEMPOTENCY_WAIT is %(wait)s, but %(why)s: duplicates get 409 at once.")
            % {"wait": wait, "why": why},
            hint=_(
                "Set IDEMPOTENCY_MAX_WAITERS to how many requests of a process may wait at "
                "once, below its thread count (and IDEMPOTENCY_SERVER_THREADS to that count), "
                "or remove IDEMPOTENCY_WAIT (docs/settings.md, waiting without starving the "
                "server)."
            ),
            id="django_idempotency.W022",
        )
    ]


def _function_setting(name: str, invalid: set[str], *, hint: str, id: str) -> list[CheckMessage]:
    """A setting that names a function: it must import, and be callable."""
    written = as_written(name)
    if written is None or name in invalid:
        return []
    problem = _not_a_function(name)
    if not problem:
        return []
    said = _("IDEMPOTENCY_%(name)s %(value)r %(problem)s.") % {
        "name": name,
        "value": written,
        "problem": problem,
    }
    return [Error(said, hint=hint, id=id)]


def _not_a_function(name: str) -> str | None:
    """Why ``IDEMPOTENCY_<name>`` does not give a function, or None when it does."""
    try:
        func = getattr(conf, name)
    except ImportError as exc:
        return _("cannot be imported (%(error)s)") % {"error": exc}
    return None if callable(func) else _("is not callable")


@register()
def check_beat(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    if not ours(app_configs) or not conf.BEAT_REGISTER:
        return []
    messages: list[CheckMessage] = []
    if not apps.is_installed("django_celery_beat"):
        messages.append(
            CheckWarning(
                _(
                    "IDEMPOTENCY_BEAT_REGISTER is True but django_celery_beat is not installed, "
                    "so no periodic task runs partition maintenance."
                ),
                hint=_(
                    "Install django-idempotency[beat] and add 'django_celery_beat' to "
                    "INSTALLED_APPS, or set IDEMPOTENCY_BEAT_REGISTER = False and schedule "
                    "`manage.py idempotency_partitions` hourly with cron or a Kubernetes "
                    "CronJob."
                ),
                id="django_idempotency.W001",
            )
        )
    try:
        beat.crontab_fields(conf.BEAT_CRONTAB)
    except ValueError as exc:
        messages.append(
            Error(
                _("IDEMPOTENCY_BEAT_CRONTAB: %(problem)s.") % {"problem": exc},
                hint=_(
                    "Five fields Celery's crontab reads: minute (0-59) hour (0-23) day-of-month "
                    '(1-31) month (1-12) day-of-week (0-6 or mon-sun), e.g. "17 * * * *".'
                ),
                id="django_idempotency.E001",
            )
        )
    return messages
