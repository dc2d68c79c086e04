"""Settings, read through ``conf`` on every access so ``override_settings`` just works.

Over 400 lines as one concern: one typed property per setting with its default, and the
table of each setting's kind that the checks validate against."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from django.conf import settings
from django.http import HttpRequest
from django.utils.functional import empty
from django.utils.module_loading import import_string

PrincipalFunc = Callable[[HttpRequest], Any]
# Principals (as stored) to the labels the admin shows; principals left out show as stored.
PrincipalDisplayFunc = Callable[[list[str]], Mapping[str, str]]
# An IdempotencyError (engine/errors.py, which conf cannot import) to the JSON body of its
# response; the package sets the status and headers.
ErrorFormatFunc = Callable[[Any], Any]


def _setting(name: str, default: Any) -> Any:
    # Read from the wrapped settings object: LazySettings.__getattr__ costs about 8 times
    # more for a setting that is not set, the usual case, and the engine reads a dozen per
    # request. override_settings swaps the wrapped object, so overrides still apply.
    # Any: the django-stubs plugin checks attribute names on it against the settings.
    lazy: Any = settings
    wrapped = lazy._wrapped
    if wrapped is empty:
        lazy._setup()
        wrapped = lazy._wrapped
    return getattr(wrapped, name, default)


class Settings:
    """One typed property per ``IDEMPOTENCY_*`` setting; the default is written inline."""

    @property
    def HEADER(self) -> str:
        return str(_setting("IDEMPOTENCY_HEADER", "Idempotency-Key"))

    @property
    def METHODS(self) -> frozenset[str]:
        methods = _setting("IDEMPOTENCY_METHODS", ("POST", "PATCH"))
        return frozenset(m.upper() for m in methods)

    @property
    def REQUIRED(self) -> bool:
        return bool(_setting("IDEMPOTENCY_REQUIRED", False))

    @property
    def TTL(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_TTL", timedelta(hours=24))
        return value

    @property
    def MAX_TTL(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_MAX_TTL", timedelta(hours=24))
        return value

    @property
    def EXPIRED_WINDOW(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_EXPIRED_WINDOW", timedelta(0))
        return value

    @property
    def WAIT(self) -> timedelta:
        # Waiting is opt-in: by default a duplicate gets 409 in-progress at once.
        value: timedelta = _setting("IDEMPOTENCY_WAIT", timedelta(0))
        return value

    @property
    def MAX_WAIT(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_MAX_WAIT", timedelta(seconds=10))
        return value

    @property
    def MAX_WAITERS(self) -> int:
        return int(_setting("IDEMPOTENCY_MAX_WAITERS", 0))

    @property
    def SERVER_THREADS(self) -> int | None:
        value = _setting("IDEMPOTENCY_SERVER_THREADS", None)
        return None if value is None else int(value)

    @property
    def RESPONSE_VERSION(self) -> str | None:
        # None: responses are not versioned (a view may still declare its own).
        value = _setting("IDEMPOTENCY_RESPONSE_VERSION", None)
        return str(value) if value else None

    @property
    def LOOKUP_FIRST(self) -> bool:
        return bool(_setting("IDEMPOTENCY_LOOKUP_FIRST", True))

    @property
    def SECRET_KEY(self) -> str | None:
        # None: the secret that the app's migration made in the records' database.
        value = _setting("IDEMPOTENCY_SECRET_KEY", None)
        return str(value) if value else None

    @property
    def SECRET_KEY_FALLBACKS(self) -> tuple[str, ...]:
        return tuple(str(value) for value in _setting("IDEMPOTENCY_SECRET_KEY_FALLBACKS", ()))

    @property
    def ENCRYPTION_KEYS(self) -> tuple[str, ...]:
        # Empty: stored responses are kept plain (storage/sealing.py parses the keys).
        return tuple(_setting("IDEMPOTENCY_ENCRYPTION_KEYS", ()))

    @property
    def ADMIN_REDACT_FIELDS(self) -> tuple[str, ...]:
        value = _setting(
            "IDEMPOTENCY_ADMIN_REDACT_FIELDS",
            (
                "card",
                "iban",
                "token",
                "password",
                "secret",
                "cvc",
                "cvv",
                "pan",
                "account_number",
                "api_key",
                "pin",
                "auth_code",
                "cardholder_name",
            ),
        )
        return tuple(value)

    @property
    def ADMIN_SHOW_FIELDS(self) -> tuple[str, ...]:
        # Empty: the admin shows no stored body to users without view_stored_response.
        return tuple(_setting("IDEMPOTENCY_ADMIN_SHOW_FIELDS", ()))

    @property
    def UNSTORED_STATUSES(self) -> frozenset[int]:
        return frozenset(_setting("IDEMPOTENCY_UNSTORED_STATUSES", (408, 409, 425, 429)))

    @property
    def REPLAY_HEADERS(self) -> tuple[str, ...]:
        return tuple(_setting("IDEMPOTENCY_REPLAY_HEADERS", ()))

    @property
    def FINGERPRINT_HEADERS(self) -> tuple[str, ...]:
        return tuple(_setting("IDEMPOTENCY_FINGERPRINT_HEADERS", ()))

    @property
    def PRINCIPAL(self) -> PrincipalFunc | None:
        value: PrincipalFunc | str | None = _setting("IDEMPOTENCY_PRINCIPAL", None)
        if isinstance(value, str):
            func: PrincipalFunc = import_string(value)
            return func
        return value

    @property
    def PRINCIPAL_DISPLAY(self) -> PrincipalDisplayFunc:
        value: PrincipalDisplayFunc | str = _setting(
            "IDEMPOTENCY_PRINCIPAL_DISPLAY", "django_idempotency.admin.usernames"
        )
        if isinstance(value, str):
            func: PrincipalDisplayFunc = import_string(value)
            return func
        return value

    @property
    def ERROR_FORMAT(self) -> str | ErrorFormatFunc:
        # "problem", "stripe", or a function (or its dotted path) that builds the body.
        value = _setting("IDEMPOTENCY_ERROR_FORMAT", "problem")
        if callable(value):
            return cast("ErrorFormatFunc", value)
        value = str(value)
        return cast("ErrorFormatFunc", import_string(value)) if "." in value else value

    @property
    def DRF_EXCEPTION_HANDLER(self) -> bool:
        return bool(_setting("IDEMPOTENCY_DRF_EXCEPTION_HANDLER", False))

    @property
    def PROBLEM_TYPE_BASE(self) -> str:
        return str(_setting("IDEMPOTENCY_PROBLEM_TYPE_BASE", "urn:django-idempotency:"))

    @property
    def COMPRESS_MIN_BYTES(self) -> int:
        return int(_setting("IDEMPOTENCY_COMPRESS_MIN_BYTES", 2048))

    @property
    def BODY_COMPRESSION(self) -> str | None:
        # None: zstd where it is installed, else zlib (storage/bodies.py).
        value = _setting("IDEMPOTENCY_BODY_COMPRESSION", None)
        return None if value is None else str(value)

    @property
    def MAX_RESPONSE_BYTES(self) -> int:
        return int(_setting("IDEMPOTENCY_MAX_RESPONSE_BYTES", 16 * 1024 * 1024))

    @property
    def MAX_STORED_ERROR_BYTES(self) -> int:
        return int(_setting("IDEMPOTENCY_MAX_STORED_ERROR_BYTES", 64 * 1024))

    @property
    def MAX_STORED_ERRORS_PER_MINUTE(self) -> int | None:
        value = _setting("IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE", 100)
        return None if value is None else int(value)

    @property
    def PARTITIONS_AHEAD(self) -> int:
        return int(_setting("IDEMPOTENCY_PARTITIONS_AHEAD", 7))

    @property
    def DROP_PARTITIONS(self) -> bool:
        return bool(_setting("IDEMPOTENCY_DROP_PARTITIONS", True))

    @property
    def PARTITION_GRACE(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_PARTITION_GRACE", timedelta(hours=1))
        return value

    @property
    def DDL_LOCK_TIMEOUT(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_DDL_LOCK_TIMEOUT", timedelta(milliseconds=50))
        return value

    @property
    def DELETE_BATCH_SIZE(self) -> int:
        return int(_setting("IDEMPOTENCY_DELETE_BATCH_SIZE", 1000))

    @property
    def BEAT_REGISTER(self) -> bool:
        return bool(_setting("IDEMPOTENCY_BEAT_REGISTER", False))

    @property
    def BEAT_CRONTAB(self) -> str:
        return str(_setting("IDEMPOTENCY_BEAT_CRONTAB", "17 * * * *"))

    @property
    def OUTBOX_RETENTION(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_OUTBOX_RETENTION", timedelta(days=7))
        return value

    @property
    def OUTBOX_POLL_INTERVAL(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_OUTBOX_POLL_INTERVAL", timedelta(seconds=5))
        return value

    @property
    def OUTBOX_MAX_AGE(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_OUTBOX_MAX_AGE", timedelta(minutes=5))
        return value

    @property
    def OUTBOX_LEASE(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_OUTBOX_LEASE", timedelta(seconds=60))
        return value

    @property
    def OUTBOX_BATCH_SIZE(self) -> int:
        return int(_setting("IDEMPOTENCY_OUTBOX_BATCH_SIZE", 500))

    @property
    def OUTBOX_EVENT_TASK(self) -> str:
        return str(_setting("IDEMPOTENCY_OUTBOX_EVENT_TASK", "django_idempotency.event"))

    @property
    def OUTBOX_CELERY_APP(self) -> str | None:
        value: str | None = _setting("IDEMPOTENCY_OUTBOX_CELERY_APP", None)
        return value

    @property
    def OUTBOX_NOTIFY(self) -> bool:
        return bool(_setting("IDEMPOTENCY_OUTBOX_NOTIFY", True))

    @property
    def OUTBOX_REDRIVE_AFTER(self) -> timedelta | None:
        value: timedelta | None = _setting(
            "IDEMPOTENCY_OUTBOX_REDRIVE_AFTER", timedelta(minutes=10)
        )
        return value

    @property
    def OUTBOX_REDRIVE_LIMIT(self) -> int:
        return int(_setting("IDEMPOTENCY_OUTBOX_REDRIVE_LIMIT", 8))

    @property
    def OUTBOX_DESTINATIONS(self) -> dict[str, Any]:
        value: dict[str, Any] = _setting(
            "IDEMPOTENCY_OUTBOX_DESTINATIONS",
            {
                "default": {
                    "BACKEND": "django_idempotency.messaging.destinations.celery.CeleryDestination"
                }
            },
        )
        return value

    @property
    def OUTBOX_ROUTES(self) -> dict[str, str]:
        value: dict[str, str] = _setting("IDEMPOTENCY_OUTBOX_ROUTES", {})
        return value

    @property
    def OUTBOX_MAX_ATTEMPTS(self) -> int:
        return int(_setting("IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS", 10))

    @property
    def PROBE_TOKEN(self) -> str | None:
        # None: the probe's run view refuses every request (its report: staff only).
        value = _setting("IDEMPOTENCY_PROBE_TOKEN", None)
        return str(value) if value else None

    @property
    def CONSUMER_TTL(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_CONSUMER_TTL", timedelta(days=7))
        return value

    @property
    def CONSUMER_WAIT(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_CONSUMER_WAIT", timedelta(seconds=10))
        return value

    @property
    def CDC_RETENTION(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_CDC_RETENTION", timedelta(days=7))
        return value

    @property
    def CDC_PUBLICATION(self) -> str | None:
        # None: no publication is expected, and its checks stay silent.
        value: str | None = _setting("IDEMPOTENCY_CDC_PUBLICATION", None)
        return value

    @property
    def CDC_CLOUDEVENTS(self) -> bool:
        return bool(_setting("IDEMPOTENCY_CDC_CLOUDEVENTS", False))

    @property
    def CDC_CLOUDEVENTS_SOURCE(self) -> str:
        return str(_setting("IDEMPOTENCY_CDC_CLOUDEVENTS_SOURCE", "/django-idempotency"))


conf = Settings()


@dataclass(frozen=True, slots=True)
class Kind:
    """What a setting's value must be: said in messages, tested by ``accepts``."""

    description: str
    accepts: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    # bool is an int, but True is no byte count.
    return isinstance(value, int) and not isinstance(value, bool)


def _sequence_of(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    # A str is a sequence of str: "POST" would be the methods P, O, S and T.
    return lambda value: isinstance(value, list | tuple | set | frozenset) and all(map(test, value))


def _or_none(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or test(value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_duration(value: Any) -> bool:
    return isinstance(value, timedelta)


def _is_function(value: Any) -> bool:
    return isinstance(value, str) or callable(value)


TEXT = Kind("a str", _is_str)
OPTIONAL_TEXT = Kind("a str, or None", _or_none(_is_str))
TEXTS = Kind("a list or tuple of str", _sequence_of(_is_str))
# A str among the fallbacks would be read one character at a time: a lock per character.
SECRETS = Kind(
    "a list or tuple of non-empty str", _sequence_of(lambda value: _is_str(value) and bool(value))
)
INTEGER = Kind("an int", _is_int)
OPTIONAL_INTEGER = Kind("an int, or None", _or_none(_is_int))
INTEGERS = Kind("a list or tuple of int", _sequence_of(_is_int))
BOOLEAN = Kind("True or False", lambda value: isinstance(value, bool))
DURATION = Kind("a datetime.timedelta", _is_duration)
OPTIONAL_DURATION = Kind("a datetime.timedelta, or None", _or_none(_is_duration))
FUNCTION = Kind("a function, or its dotted path as a str", _is_function)
MAPPING = Kind("a dict", lambda value: isinstance(value, dict))
ERROR_FORMAT_KIND = Kind(
    '"problem", "stripe", a function, or its dotted path as a str', _is_function
)
OPTIONAL_FUNCTION = Kind("a function, its dotted path as a str, or None", _or_none(_is_function))

# What every IDEMPOTENCY_<name> setting must be; the settings' docs say the same. A setting
# left out here is a test failure (tests/operators/test_checks.py).
KINDS: dict[str, Kind] = {
    "HEADER": TEXT,
    "METHODS": TEXTS,
    "REQUIRED": BOOLEAN,
    "TTL": DURATION,
    "MAX_TTL": DURATION,
    "EXPIRED_WINDOW": DURATION,
    "WAIT": DURATION,
    "MAX_WAIT": DURATION,
    "MAX_WAITERS": INTEGER,
    "SERVER_THREADS": OPTIONAL_INTEGER,
    "LOOKUP_FIRST": BOOLEAN,
    "RESPONSE_VERSION": OPTIONAL_TEXT,
    "SECRET_KEY": OPTIONAL_TEXT,
    "SECRET_KEY_FALLBACKS": SECRETS,
    "ENCRYPTION_KEYS": SECRETS,
    "ADMIN_REDACT_FIELDS": TEXTS,
    "ADMIN_SHOW_FIELDS": TEXTS,
    "UNSTORED_STATUSES": INTEGERS,
    "REPLAY_HEADERS": TEXTS,
    "FINGERPRINT_HEADERS": TEXTS,
    "PRINCIPAL": OPTIONAL_FUNCTION,
    "PRINCIPAL_DISPLAY": FUNCTION,
    "ERROR_FORMAT": ERROR_FORMAT_KIND,
    "DRF_EXCEPTION_HANDLER": BOOLEAN,
    "PROBLEM_TYPE_BASE": TEXT,
    "COMPRESS_MIN_BYTES": INTEGER,
    "BODY_COMPRESSION": OPTIONAL_TEXT,
    "MAX_RESPONSE_BYTES": INTEGER,
    "MAX_STORED_ERROR_BYTES": INTEGER,
    "MAX_STORED_ERRORS_PER_MINUTE": OPTIONAL_INTEGER,
    "PARTITIONS_AHEAD": INTEGER,
    "DROP_PARTITIONS": BOOLEAN,
    "PARTITION_GRACE": DURATION,
    "DDL_LOCK_TIMEOUT": DURATION,
    "DELETE_BATCH_SIZE": INTEGER,
    "BEAT_REGISTER": BOOLEAN,
    "BEAT_CRONTAB": TEXT,
    "OUTBOX_RETENTION": DURATION,
    "OUTBOX_POLL_INTERVAL": DURATION,
    "OUTBOX_MAX_AGE": DURATION,
    "OUTBOX_LEASE": DURATION,
    "OUTBOX_BATCH_SIZE": INTEGER,
    "OUTBOX_EVENT_TASK": TEXT,
    "OUTBOX_CELERY_APP": OPTIONAL_TEXT,
    "OUTBOX_NOTIFY": BOOLEAN,
    "OUTBOX_REDRIVE_AFTER": OPTIONAL_DURATION,
    "OUTBOX_REDRIVE_LIMIT": INTEGER,
    "OUTBOX_DESTINATIONS": MAPPING,
    "OUTBOX_ROUTES": MAPPING,
    "OUTBOX_MAX_ATTEMPTS": INTEGER,
    "PROBE_TOKEN": OPTIONAL_TEXT,
    "CONSUMER_TTL": DURATION,
    "CONSUMER_WAIT": DURATION,
    "CDC_RETENTION": DURATION,
    "CDC_PUBLICATION": OPTIONAL_TEXT,
    "CDC_CLOUDEVENTS": BOOLEAN,
    "CDC_CLOUDEVENTS_SOURCE": TEXT,
}

# The settings a request reads: a wrong type among them refuses the request (500
# misconfigured) instead of failing somewhere inside it.
REQUEST_SETTINGS = (
    "HEADER",
    "METHODS",
    "REQUIRED",
    "TTL",
    "MAX_TTL",
    "EXPIRED_WINDOW",
    "WAIT",
    "MAX_WAIT",
    "MAX_WAITERS",
    "SERVER_THREADS",
    "LOOKUP_FIRST",
    "RESPONSE_VERSION",
    "SECRET_KEY",
    "SECRET_KEY_FALLBACKS",
    "ENCRYPTION_KEYS",
    "UNSTORED_STATUSES",
    "REPLAY_HEADERS",
    "FINGERPRINT_HEADERS",
    "PRINCIPAL",
    "COMPRESS_MIN_BYTES",
    "BODY_COMPRESSION",
    "MAX_RESPONSE_BYTES",
    "MAX_STORED_ERROR_BYTES",
    "MAX_STORED_ERRORS_PER_MINUTE",
)
_UNSET = object()


def wrong_type(name: str) -> str | None:
    """What is wrong with ``IDEMPOTENCY_<name>``'s type ("IDEMPOTENCY_TTL is 3600 (int); it
    must be a datetime.timedelta."), or None when it is unset or of its kind."""
    value = _setting(f"IDEMPOTENCY_{name}", _UNSET)
    kind = KINDS[name]
    if value is _UNSET or kind.accepts(value):
        return None
    return (
        f"IDEMPOTENCY_{name} is {value!r} ({type(value).__name__}); it must be {kind.description}."
    )
