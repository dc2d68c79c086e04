"""A project without Celery whose outbox goes to Django's Tasks framework only (found by the
adopter's project, .ci/adopter): its one destination is the default one, the Tasks
destination, and the outbox backend sends its tasks there without being told
(docs/outbox.md, Without Celery)."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from django_idempotency.checks.messaging import check_task_backends
from django_idempotency.messaging import destinations
from django_idempotency.messaging.relay.loop import Relay
from django_idempotency.messaging.tasks_framework import task_backends
from django_idempotency.models import OutboxMessage
from tests.support.task_targets import record

pytestmark = pytest.mark.django_db(transaction=True)

FRAMEWORK = "django.tasks" if importlib.util.find_spec("django.tasks") else "django_tasks"
pytest.importorskip(FRAMEWORK)
with contextlib.suppress(ImportError):  # the backport forgets its backends on a change
    import django_tasks.signals  # noqa: F401

OUTBOX_BACKEND = "django_idempotency.messaging.task_backend.OutboxBackend"
TASKS_ONLY: dict[str, Any] = {
    "TASKS": {
        "default": {"BACKEND": OUTBOX_BACKEND, "OPTIONS": {"backend": "dummy"}},
        "dummy": {"BACKEND": f"{FRAMEWORK}.backends.dummy.DummyBackend"},
    },
    "IDEMPOTENCY_OUTBOX_DESTINATIONS": {"default": {"BACKEND": destinations.TASKS}},
}


@pytest.fixture(autouse=True)
def tasks_only(settings: Any) -> None:
    # Through pytest-django's fixture, which the tests change further: under an
    # @override_settings decorator its teardown would restore the decorator's settings and
    # leave them on for the modules that run next.
    for name, value in TASKS_ONLY.items():
        setattr(settings, name, value)


def test_the_tasks_destination_as_the_default_needs_no_destination_option() -> None:
    assert check_task_backends(None) == []
    with transaction.atomic():
        message_id = record.enqueue(7).id
    assert OutboxMessage.objects.get().options["destination"] == "default"
    relay = Relay()
    try:
        assert relay.drain() == 1
    finally:
        relay.destinations.close()
    (handed,) = task_backends["dummy"].results
    assert handed.args[0] == message_id


def test_a_destination_named_in_the_options_is_still_the_one_used(settings: Any) -> None:
    settings.TASKS = {
        **TASKS_ONLY["TASKS"],
        "default": {"BACKEND": OUTBOX_BACKEND, "OPTIONS": {"backend": "dummy", "destination": "x"}},
    }
    (error,) = check_task_backends(None)
    assert "no 'x' destination" in error.msg


def test_without_a_default_destination_the_error_shows_the_tasks_only_setting(
    settings: Any,
) -> None:
    settings.IDEMPOTENCY_OUTBOX_DESTINATIONS = {"tasks": {"BACKEND": destinations.TASKS}}
    with pytest.raises(ImproperlyConfigured, match="in a project without Celery") as raised:
        destinations.configured()
    assert f"{{'default': {{\"BACKEND\": {destinations.TASKS!r}}}}}" in str(raised.value)
