"""The relays' heartbeats in the admin: which relays run, where, since when, when each last
beat and what it published; read-only, as the relays write them."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin.base import ModelAdminOf, time_column
from django_idempotency.messaging.relay import heartbeats
from django_idempotency.models import RelayHeartbeat


@admin.register(RelayHeartbeat)
class RelayHeartbeatAdmin(ModelAdminOf[RelayHeartbeat]):
    # One row per relay: a small table, counted and sorted as Django does.
    list_display = (
        "owner",
        "host",
        "pid",
        "started",
        "beat",
        "beat_age",
        "published",
        "failed",
    )
    started = time_column("started_at", _("started at"))
    beat = time_column("beat_at", _("last beat at"))
    ordering = ("-beat_at",)
    readonly_fields = (
        "owner",
        "host",
        "pid",
        "started_at",
        "beat_at",
        "beat_age",
        "published",
        "failed",
        "last_error",
    )
    actions = None

    @admin.display(description=_("last beat"))
    def beat_age(self, obj: RelayHeartbeat) -> str:
        seconds = heartbeats.age(obj)
        if heartbeats.alive(obj):
            return gettext("%(seconds)d s ago") % {"seconds": seconds}
        return gettext("%(seconds)d s ago: stale, the relay died or hangs") % {"seconds": seconds}

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A running relay writes its row again within seconds; a dead one's row is the news.
        return False
