"""The event table's admin: what was emitted for change data capture, newest first, found by
its exact id; read-only, since the table is insert-only and leaves by partition drop."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin.base import ReadOnlyLargeTableAdmin, exact_id_search, time_column
from django_idempotency.admin.outbox import OutboxCreatedFilter
from django_idempotency.models import OutboxEvent


@admin.register(OutboxEvent)
class OutboxEventAdmin(ReadOnlyLargeTableAdmin[OutboxEvent]):
    # By id, as the base orders: newest first for random UUIDv7 ids, while ids named by a
    # request sort among them by their hash. Payloads may be large.
    detail_only_fields = ("payload",)
    list_display = ("id", "aggregate_type", "aggregate_id", "event_type", "created")
    created = time_column("created_at", _("created at"))
    list_filter = (OutboxCreatedFilter,)
    search_fields = ("id",)
    search_help_text = _("The exact event id, which Debezium puts in the message's id header.")
    fields = ("id", "created_at", "aggregate_type", "aggregate_id", "event_type", "payload")
    readonly_fields = fields

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[OutboxEvent], search_term: str
    ) -> tuple[QuerySet[OutboxEvent], bool]:
        return exact_id_search(queryset, search_term), False

    def has_delete_permission(self, request: HttpRequest, obj: OutboxEvent | None = None) -> bool:
        # Deleted rows would not leave Kafka; a DELETE is also not what the slot should see.
        return False
