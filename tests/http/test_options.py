"""A view's options over the settings: ``resolve`` and ``policy_for``."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.test import override_settings

from django_idempotency.engine.errors import Misconfigured
from django_idempotency.http.options import OPTION_NAMES, ViewOptions, policy_for, resolve


def tenant(request: Any) -> str:
    return "tenant:1"


def event_id(request: HttpRequest) -> str | None:
    return "evt_1"


def shard(request: HttpRequest) -> str:
    return "default"


def test_option_names_are_the_view_options_declared_once() -> None:
    assert tuple(ViewOptions.__annotations__) == OPTION_NAMES
    assert "key_from" in OPTION_NAMES and "allow_anonymous" in OPTION_NAMES


def test_no_options_take_the_settings_defaults() -> None:
    policy = resolve({})
    assert policy.methods == frozenset({"POST", "PATCH"})
    assert policy.required is False
    assert policy.ttl == timedelta(hours=24)
    assert policy.wait == timedelta(0)
    assert policy.exclude_fields == ()
    assert policy.fingerprint_headers == ()
    assert policy.principal is None
    assert policy.lookup_first is True
    assert policy.using is None
    assert policy.allow_anonymous is False
    assert policy.key_from is None
    assert (policy.header, policy.header_meta) == ("Idempotency-Key", "HTTP_IDEMPOTENCY_KEY")


def test_options_left_as_none_take_the_settings() -> None:
    options: ViewOptions = {name: None for name in OPTION_NAMES}  # type: ignore[misc]
    with override_settings(
        IDEMPOTENCY_METHODS=["put"],
        IDEMPOTENCY_REQUIRED=True,
        IDEMPOTENCY_TTL=timedelta(hours=2),
        IDEMPOTENCY_WAIT=timedelta(seconds=3),
        IDEMPOTENCY_FINGERPRINT_HEADERS=["X-Account"],
        IDEMPOTENCY_LOOKUP_FIRST=False,
        IDEMPOTENCY_HEADER="X-Request-Key",
        IDEMPOTENCY_PRINCIPAL="tests.http.test_options.tenant",
    ):
        policy = resolve(options)
    assert policy.methods == frozenset({"PUT"})
    assert policy.required is True
    assert policy.ttl == timedelta(hours=2)
    assert policy.wait == timedelta(seconds=3)
    assert policy.fingerprint_headers == ("X-Account",)
    assert policy.lookup_first is False
    assert policy.principal is tenant
    assert (policy.header, policy.header_meta) == ("X-Request-Key", "HTTP_X_REQUEST_KEY")


def test_per_view_options_override_the_settings() -> None:
    with override_settings(IDEMPOTENCY_REQUIRED=True, IDEMPOTENCY_LOOKUP_FIRST=True):
        policy = resolve(
            {
                "methods": ["post", "delete"],
                "required": False,
                "ttl": timedelta(hours=1),
                "wait": timedelta(seconds=5),
                "exclude_fields": ["client_ts", "meta.sent_at"],
                "fingerprint_headers": ["X-Account"],
                "principal": tenant,
                "lookup_first": False,
                "key_header": "X-GitHub-Delivery",
                "using": shard,
                "allow_anonymous": True,
            }
        )
    assert policy.methods == frozenset({"POST", "DELETE"})
    assert policy.required is False
    assert policy.ttl == timedelta(hours=1)
    assert policy.wait == timedelta(seconds=5)
    assert policy.exclude_fields == ("client_ts", "meta.sent_at")
    assert policy.fingerprint_headers == ("X-Account",)
    assert policy.principal is tenant
    assert policy.lookup_first is False
    assert policy.using is shard
    assert policy.allow_anonymous is True
    assert (policy.header, policy.header_meta) == ("X-GitHub-Delivery", "HTTP_X_GITHUB_DELIVERY")


def test_no_view_outlives_the_maximum_ttl() -> None:
    with override_settings(IDEMPOTENCY_MAX_TTL=timedelta(hours=6)):
        assert resolve({"ttl": timedelta(days=30)}).ttl == timedelta(hours=6)
        assert resolve({}).ttl == timedelta(hours=6)


def test_functions_stored_on_a_view_class_come_back_unbound() -> None:
    class View:
        idempotency_principal = tenant
        idempotency_key_from = event_id
        idempotency_using = shard

    view = View()
    policy = resolve(
        {
            "principal": view.idempotency_principal,
            "key_from": view.idempotency_key_from,
            "using": view.idempotency_using,
        }
    )
    assert (policy.principal, policy.key_from, policy.using) == (tenant, event_id, shard)


def test_key_header_and_key_from_together_are_a_clear_error() -> None:
    with pytest.raises(ImproperlyConfigured, match="both key_header and key_from"):
        resolve({"key_header": "X-Delivery", "key_from": event_id})


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("IDEMPOTENCY_TTL", 3600),
        ("IDEMPOTENCY_REQUIRED", "False"),
        ("IDEMPOTENCY_METHODS", "POST"),
        ("IDEMPOTENCY_PRINCIPAL", "tests.http.test_options.no_such_function"),
        ("IDEMPOTENCY_PRINCIPAL", 42),
    ],
)
def test_a_bad_setting_refuses_the_view_as_misconfigured_with_an_error_log(
    setting: str, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        override_settings(**{setting: value}),
        caplog.at_level(logging.ERROR, logger="django_idempotency"),
        pytest.raises(Misconfigured),
    ):
        resolve({})
    assert setting in caplog.text and "manage.py check" in caplog.text


def test_policies_are_cached_per_owner_and_option_values() -> None:
    def view() -> None: ...

    options: ViewOptions = {"ttl": timedelta(hours=1)}
    first = policy_for(view, options)
    assert policy_for(view, options) is first
    assert policy_for(view, {"ttl": timedelta(hours=2)}).ttl == timedelta(hours=2)
    assert policy_for(lambda: None, options) is not first


def test_a_changed_setting_drops_the_cached_policies() -> None:
    def view() -> None: ...

    options: ViewOptions = {}
    assert policy_for(view, options).required is False
    with override_settings(IDEMPOTENCY_REQUIRED=True):
        assert policy_for(view, options).required is True
    assert policy_for(view, options).required is False
