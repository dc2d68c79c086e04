"""Settings, read through ``conf`` on every access so ``override_settings`` just works."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.utils.functional import empty
from django.utils.module_loading import import_string

PrincipalFunc = Callable[[HttpRequest], Any]
# Principals (as stored) to the labels the admin shows; principals left out show as stored.
PrincipalDisplayFunc = Callable[[list[str]], Mapping[str, str]]


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
    def LOOKUP_FIRST(self) -> bool:
        return bool(_setting("IDEMPOTENCY_LOOKUP_FIRST", False))

    @property
    def SECRET_KEY(self) -> str:
        return str(_setting("IDEMPOTENCY_SECRET_KEY", None) or _setting("SECRET_KEY", ""))

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
    def ERROR_FORMAT(self) -> str:
        return str(_setting("IDEMPOTENCY_ERROR_FORMAT", "problem"))

    @property
    def PROBLEM_TYPE_BASE(self) -> str:
        return str(_setting("IDEMPOTENCY_PROBLEM_TYPE_BASE", "urn:django-idempotency:"))

    @property
    def COMPRESS_MIN_BYTES(self) -> int:
        return int(_setting("IDEMPOTENCY_COMPRESS_MIN_BYTES", 2048))

    @property
    def MAX_RESPONSE_BYTES(self) -> int:
        return int(_setting("IDEMPOTENCY_MAX_RESPONSE_BYTES", 16 * 1024 * 1024))

    @property
    def MAX_STORED_ERROR_BYTES(self) -> int:
        return int(_setting("IDEMPOTENCY_MAX_STORED_ERROR_BYTES", 64 * 1024))

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
    def CONSUMER_TTL(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_CONSUMER_TTL", timedelta(days=7))
        return value

    @property
    def CONSUMER_WAIT(self) -> timedelta:
        value: timedelta = _setting("IDEMPOTENCY_CONSUMER_WAIT", timedelta(seconds=10))
        return value


conf = Settings()
