"""Fault switches read from a payment request's body, to show and test failure handling.

They do anything only when ``settings.PAYMENTS_FAULTS_ENABLED`` is true (the demo and the
test settings); otherwise the fields are ignored like any other unknown field.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.http.response import HttpResponseBase
from django.utils import timezone
from rest_framework import serializers

from testproject.payments.models import FaultTag

FAIL_RAISE = "500"
FAIL_RESPOND = "500r"
FAIL_AFTER_WRITE = "after_write"
# Writes, then marks the transaction for rollback without raising, and answers 201: the
# "catch the IntegrityError and carry on" pattern. Nothing commits; the 201 must not stand.
FAIL_ROLLBACK_ONLY = "rollback_only"
COOKIE_NAME = "payments_fault"

R = TypeVar("R", bound=HttpResponseBase)


class InjectedFault(Exception):
    """Raised by a fault switch; nothing handles it, so the request ends in a 500."""


class FaultsSerializer(serializers.Serializer[Any]):
    # Built here rather than declared: a field attribute named "fail" would shadow the
    # serializer's own fail() method.
    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        return {
            "fail": serializers.ChoiceField(
                [FAIL_RAISE, FAIL_RESPOND, FAIL_AFTER_WRITE, FAIL_ROLLBACK_ONLY], default=""
            ),
            "fail_once": serializers.CharField(max_length=255, default=""),
            "crash_once": serializers.CharField(max_length=255, default=""),
            "delay_ms": serializers.IntegerField(min_value=0, max_value=60_000, default=0),
            "set_cookie": serializers.CharField(max_length=255, default=""),
            # Passed on to the charge's ledger task (``post_ledger_entry``'s own switches).
            "ledger_crash_once": serializers.CharField(max_length=255, default=""),
            "ledger_crash_after_commit_once": serializers.CharField(max_length=255, default=""),
            "ledger_delay_ms": serializers.IntegerField(min_value=0, max_value=60_000, default=0),
        }


@dataclass(frozen=True)
class Faults:
    """What to break in this request; the default breaks nothing."""

    fail: str = ""
    fail_once: str = ""
    crash_once: str = ""
    delay_ms: int = 0
    set_cookie: str = ""
    ledger_crash_once: str = ""
    ledger_crash_after_commit_once: str = ""
    ledger_delay_ms: int = 0

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Faults:
        if not getattr(settings, "PAYMENTS_FAULTS_ENABLED", False):
            return cls()
        switches = FaultsSerializer(data=data)
        switches.is_valid(raise_exception=True)
        return cls(**switches.validated_data)

    def before_write(self) -> None:
        if self.delay_ms:
            time.sleep(self.delay_ms / 1000)
        if self.fail == FAIL_RAISE:
            raise InjectedFault("fail=500: raised before writing")

    @property
    def ledger_switches(self) -> dict[str, Any]:
        """The ledger task's fault switches this request asks for, as its keyword arguments."""
        switches = {
            "crash_once": self.ledger_crash_once,
            "crash_after_commit_once": self.ledger_crash_after_commit_once,
            "delay_ms": self.ledger_delay_ms,
        }
        return {name: value for name, value in switches.items() if value}

    @property
    def responds_with_error(self) -> bool:
        return self.fail == FAIL_RESPOND

    def after_write(self) -> None:
        if self.fail == FAIL_ROLLBACK_ONLY:
            # Outside an atomic block (the unprotected baseline) Django raises here.
            transaction.set_rollback(True)
        if self.fail == FAIL_AFTER_WRITE:
            raise InjectedFault("fail=after_write: raised after writing")
        if self.fail_once and first_sighting(f"fail_once:{self.fail_once}"):
            raise InjectedFault(f"fail_once={self.fail_once}: raised after writing")
        if self.crash_once and first_sighting(f"crash_once:{self.crash_once}"):
            # Like a power cut or the OOM killer: no exception handler, no rollback, no reply.
            os._exit(1)


def with_cookie(response: R, data: Mapping[str, Any]) -> R:
    """The view's response, with the ``set_cookie`` switch's cookie if the body asks for one
    (a replay must never carry it)."""
    value = Faults.from_data(data).set_cookie
    if value:
        response.set_cookie(COOKIE_NAME, value, httponly=True, samesite="Lax")
    return response


def first_sighting(tag: str) -> bool:
    """Record ``tag``; true only for the first request, in any worker process, to see it."""
    # A connection of its own in autocommit mode: the tag stays recorded when the request's
    # transaction rolls back or its worker dies, and every worker process sees it at once.
    connection = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {connection.ops.quote_name(FaultTag._meta.db_table)} "
                "(tag, seen_at) VALUES (%s, %s) ON CONFLICT (tag) DO NOTHING",
                [tag, timezone.now()],
            )
            inserted: int = cursor.rowcount
    finally:
        connection.close()
    return inserted == 1
