"""The outbox's admin: messages by state and age, found by their exact id, dead letters
counted and requeued; nothing deleted, since the outbox is append-only."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.db import router
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin.base import ReadOnlyLargeTableAdmin, exact_id_search, time_column
from django_idempotency.messaging.outbox import leases
from django_idempotency.models import OutboxMessage

# Dead letters are counted (on their own partial index) up to this many for the filter.
DEAD_COUNT_LIMIT = 10_000

# Columns the list never shows: arguments and payloads may be large.
OUTBOX_DETAIL_ONLY_FIELDS = ("args", "kwargs", "payload", "options", "last_error")


class OutboxStateFilter(admin.SimpleListFilter):
    # "pending" and "failing" read the partial index of unpublished rows only, "checking"
    # the redrive's partial index.
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        using = router.db_for_read(OutboxMessage)
        dead = leases.dead_letters(using, DEAD_COUNT_LIMIT)
        shown = f"{dead}+" if dead >= DEAD_COUNT_LIMIT else str(dead)
        return [
            ("pending", gettext("Pending")),
            ("failing", gettext("Pending, after a failed publish")),
            # dead is the count, shown may add "+" past the limit; the plural follows dead.
            (
                "dead",
                ngettext("Dead letter (%(count)s)", "Dead letters (%(count)s)", dead)
                % {"count": shown},
            ),
            ("published", gettext("Published")),
            ("checking", gettext("Published, consumer's record not yet checked")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value == "pending":
            return queryset.filter(published_at__isnull=True, dead_at__isnull=True)
        if value == "failing":
            return queryset.filter(published_at__isnull=True, dead_at__isnull=True, attempts__gt=0)
        if value == "dead":
            return queryset.filter(dead_at__isnull=False)
        if value == "published":
            return queryset.filter(published_at__isnull=False)
        if value == "checking":
            return queryset.filter(redrive_at__isnull=False)
        raise IncorrectLookupParameters(value)


class OutboxCreatedFilter(admin.SimpleListFilter):
    """Recent time ranges, which PostgreSQL prunes to the partitions they cover."""

    title = _("created")
    parameter_name = "created"
    recent = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7)}

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("1h", gettext("Last hour")),
            ("24h", gettext("Last 24 hours")),
            ("7d", gettext("Last 7 days")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value not in self.recent:
            raise IncorrectLookupParameters(value)
        return queryset.filter(created_at__gte=timezone.now() - self.recent[value])


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyLargeTableAdmin[OutboxMessage]):
    # By id, as the base orders (its index; created_at has none): newest first for random
    # UUIDv7 ids, while ids named by a request sort among them by their hash.
    detail_only_fields = OUTBOX_DETAIL_ONLY_FIELDS
    list_display = (
        "id",
        "kind",
        "name",
        "created",
        "published",
        "attempts",
        "dead",
        "redrives",
    )
    created = time_column("created_at", _("created at"))
    published = time_column("published_at", _("published at"))
    dead = time_column("dead_at", _("dead letter since"))
    list_filter = (OutboxStateFilter, OutboxCreatedFilter, "kind")
    search_fields = ("id",)
    search_help_text = _("The exact message id, which is the Celery task id.")
    fieldsets = (
        (_("Message"), {"fields": ("id", "kind", "name", "args", "kwargs", "payload", "options")}),
        (
            _("Publishing"),
            {"fields": ("created_at", "published_at", "attempts", "dead_at", "last_error")},
        ),
        (_("Lease"), {"fields": ("lease_owner", "lease_until", "fence")}),
        (_("Redrive"), {"fields": ("consumer_check_due", "redrives")}),
        # A message waits for every earlier one of its key (a dead one too) to be published.
        (_("Order"), {"fields": ("ordering_key", "ordering_seq")}),
    )
    readonly_fields = (
        "id",
        "kind",
        "name",
        "args",
        "kwargs",
        "payload",
        "options",
        "created_at",
        "published_at",
        "attempts",
        "dead_at",
        "last_error",
        "lease_owner",
        "lease_until",
        "fence",
        "consumer_check_due",
        "redrives",
        "ordering_key",
        "ordering_seq",
    )

    # The one bulk action: dead letters back to be published, under the same ids.
    actions = ["requeue"]  # type: ignore[assignment]  # the base declares None (no action)

    @admin.action(description=_("Requeue the selected dead letters"), permissions=["requeue"])
    def requeue(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        ids = [
            str(pk) for pk in queryset.filter(dead_at__isnull=False).values_list("pk", flat=True)
        ]
        count = leases.requeue(queryset.db, ids) if ids else 0
        self.message_user(
            request,
            ngettext(
                "Requeued %(count)d dead letter; it is published again with the same id.",
                "Requeued %(count)d dead letters; they are published again with the same ids.",
                count,
            )
            % {"count": count},
            messages.SUCCESS if count else messages.WARNING,
        )

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        # Changing a row is what requeuing does; the admin itself changes nothing else.
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[OutboxMessage], search_term: str
    ) -> tuple[QuerySet[OutboxMessage], bool]:
        return exact_id_search(queryset, search_term), False

    # redrive_at is when the relay will look for the consumer's record: a time to come.
    @admin.display(description=_("consumer's record to be checked at"))
    def consumer_check_due(self, obj: OutboxMessage) -> Any:
        return obj.redrive_at or "-"

    def has_delete_permission(self, request: HttpRequest, obj: OutboxMessage | None = None) -> bool:
        # A deleted pending message would never be published: the outbox is append-only.
        return False
