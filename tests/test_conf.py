"""The settings object (``conf.py``): defaults, overrides read at once, and the table of kinds
that the checks and the request path judge a setting's type by."""

# ruff: noqa: SIM300  (conf.TTL and the like are properties, not the constants ruff takes them for)

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings

from django_idempotency.conf import KINDS, REQUEST_SETTINGS, Settings, conf, wrong_type

PROPERTIES = sorted(name for name, value in vars(Settings).items() if isinstance(value, property))


def principal_of(request: Any) -> str:
    return "from-conf-test"


def test_every_setting_has_a_kind_and_every_kind_a_setting() -> None:
    assert sorted(KINDS) == PROPERTIES


def test_the_request_settings_are_settings() -> None:
    assert set(REQUEST_SETTINGS) <= set(KINDS)
    assert len(REQUEST_SETTINGS) == len(set(REQUEST_SETTINGS))


@pytest.mark.parametrize("name", PROPERTIES)
def test_each_default_is_of_its_own_kind(name: str, settings: Any) -> None:
    if hasattr(settings, f"IDEMPOTENCY_{name}"):
        delattr(settings, f"IDEMPOTENCY_{name}")
    raw = {"PRINCIPAL_DISPLAY": "django_idempotency.admin.usernames"}.get(name)
    value = raw if raw is not None else getattr(conf, name)
    if isinstance(value, frozenset):  # METHODS and UNSTORED_STATUSES are read into sets
        value = tuple(value)
    assert KINDS[name].accepts(value), (name, value)
    assert wrong_type(name) is None


def test_the_documented_defaults(settings: Any) -> None:
    for name in ("TTL", "WAIT", "METHODS", "MAX_WAITERS", "UNSTORED_STATUSES", "SECRET_KEY"):
        if hasattr(settings, f"IDEMPOTENCY_{name}"):
            delattr(settings, f"IDEMPOTENCY_{name}")
    assert conf.TTL == timedelta(hours=24)
    assert conf.WAIT == timedelta(0)  # waiting is opt-in
    assert conf.METHODS == frozenset({"POST", "PATCH"})
    assert conf.MAX_WAITERS == 0
    assert conf.UNSTORED_STATUSES == frozenset({408, 409, 425, 429})
    assert conf.SECRET_KEY is None  # the secret the migration made


def test_an_override_is_read_on_the_next_access_and_gone_after_it() -> None:
    before = conf.TTL
    with override_settings(IDEMPOTENCY_TTL=timedelta(minutes=5)):
        assert conf.TTL == timedelta(minutes=5)
    assert conf.TTL == before


def test_methods_are_upper_cased() -> None:
    with override_settings(IDEMPOTENCY_METHODS=["post", "Delete"]):
        assert conf.METHODS == frozenset({"POST", "DELETE"})


def test_a_function_setting_takes_a_dotted_path_or_the_function() -> None:
    with override_settings(IDEMPOTENCY_PRINCIPAL=f"{__name__}.principal_of"):
        assert conf.PRINCIPAL is principal_of
    with override_settings(IDEMPOTENCY_PRINCIPAL=principal_of):
        assert conf.PRINCIPAL is principal_of
    with override_settings(IDEMPOTENCY_PRINCIPAL=None):
        assert conf.PRINCIPAL is None


def test_none_turns_off_what_may_be_turned_off() -> None:
    with override_settings(
        IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE=None,
        IDEMPOTENCY_SERVER_THREADS=None,
        IDEMPOTENCY_OUTBOX_REDRIVE_AFTER=None,
    ):
        assert conf.MAX_STORED_ERRORS_PER_MINUTE is None
        assert conf.SERVER_THREADS is None
        assert conf.OUTBOX_REDRIVE_AFTER is None


def test_an_empty_secret_key_means_the_migrations_secret() -> None:
    with override_settings(IDEMPOTENCY_SECRET_KEY=""):
        assert conf.SECRET_KEY is None


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("TTL", 3600, "IDEMPOTENCY_TTL is 3600 (int); it must be a datetime.timedelta."),
        ("MAX_WAITERS", True, "IDEMPOTENCY_MAX_WAITERS is True (bool); it must be an int."),
        ("METHODS", "POST", "it must be a list or tuple of str."),
        ("SECRET_KEY_FALLBACKS", "old", "it must be a list or tuple of non-empty str."),
        ("SECRET_KEY_FALLBACKS", ["old", ""], "it must be a list or tuple of non-empty str."),
        ("UNSTORED_STATUSES", [409, "429"], "it must be a list or tuple of int."),
        ("PRINCIPAL", 42, "it must be a function, its dotted path as a str, or None."),
        ("OUTBOX_REDRIVE_AFTER", 600, "it must be a datetime.timedelta, or None."),
        ("REQUIRED", "yes", "it must be True or False."),
    ],
)
def test_a_value_of_the_wrong_kind_is_named_with_the_fix(name: str, value: Any, said: str) -> None:
    with override_settings(**{f"IDEMPOTENCY_{name}": value}):
        message = wrong_type(name)
    assert message is not None and message.endswith(said), message
    assert message.startswith(f"IDEMPOTENCY_{name} is {value!r}")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TTL", timedelta(hours=1)),
        ("METHODS", ("POST",)),
        ("SERVER_THREADS", None),
        ("SERVER_THREADS", 4),
        ("PRINCIPAL", principal_of),
        ("SECRET_KEY_FALLBACKS", ["old-secret"]),
    ],
)
def test_a_value_of_its_kind_is_accepted(name: str, value: Any) -> None:
    with override_settings(**{f"IDEMPOTENCY_{name}": value}):
        assert wrong_type(name) is None
