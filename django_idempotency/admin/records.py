"""The records' admin: filters whose choices come from the URLconf and the partition catalog
(no ``SELECT DISTINCT``), an exact key or username search, principals shown by name; stored
responses as ``admin/responses.py`` lets the user see them.

Over 400 lines as one concern: the admin class and the filters and principal lookups only it
uses (a table of billions of rows needs each of them written for it)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import date, timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import connections
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin import responses
from django_idempotency.admin.base import (
    DetailDeferringChangeList,
    ReadOnlyLargeTableAdmin,
    time_column,
)
from django_idempotency.conf import conf
from django_idempotency.engine.errors import InvalidKey
from django_idempotency.engine.work import PARTS
from django_idempotency.http.endpoints import idempotent_endpoints
from django_idempotency.http.identity import parse_key
from django_idempotency.models import IdempotencyRecord
from django_idempotency.partitions import catalog
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.storage import records
from django_idempotency.storage.erasure import (
    BATCH,
    TOMBSTONE_PREFIX,
    ErasureIncomplete,
    erase,
)

# How long the erase action waits for requests in flight (a web request: shorter than the
# command's).
ADMIN_ERASE_WAIT = timedelta(seconds=10)
# Columns the list never shows; a stored body alone may be megabytes.
DETAIL_ONLY_FIELDS = ("fingerprint", "response_headers", "response_body")


def _user_kinds() -> frozenset[str]:
    # The default principal of an authenticated user, and what a principal callable that
    # returns the user instance stores (the model's label, such as auth.user).
    return frozenset({"user", get_user_model()._meta.label_lower})


def usernames(principals: list[str]) -> dict[str, str]:
    """The default ``IDEMPOTENCY_PRINCIPAL_DISPLAY``: a user's principal (``user:<pk>``, or
    ``auth.user:<pk>`` from a principal callable) to their username, in one query."""
    User = get_user_model()
    kinds = _user_kinds()
    pks: dict[str, Any] = {}
    for principal in principals:
        kind, _, raw_pk = principal.partition(":")
        if kind in kinds:
            with contextlib.suppress(ValidationError):  # not a pk of this user model
                pks[principal] = User._meta.pk.to_python(raw_pk)
    if not pks:
        return {}
    users = User._default_manager.filter(pk__in=set(pks.values()))
    names = {user.pk: user.get_username() for user in users}
    return {principal: names[pk] for principal, pk in pks.items() if pk in names}


def principals_of_username(username: str) -> list[str]:
    """The principals a user's records can have (see ``usernames``); none if no user has
    this username."""
    User = get_user_model()
    pk = User._default_manager.filter(**{User.USERNAME_FIELD: username}).values_list(
        "pk", flat=True
    )[:1]
    return user_principals(pk[0]) if pk else []


def user_principals(pk: Any) -> list[str]:
    """The principals a user's records can have, from the user's primary key."""
    return [f"{kind}:{pk}" for kind in sorted(_user_kinds())]


def _principal_label(principal: str, labels: Mapping[str, str]) -> str:
    label = labels.get(principal)
    return principal if label is None else f"{label} ({principal})"


class RecordChangeList(DetailDeferringChangeList):
    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        # One call to the display hook for the whole page, not one per row.
        page = list(self.result_list)
        labels = conf.PRINCIPAL_DISPLAY(sorted({record.scope for record in page}))
        for record in page:
            record.principal_label = _principal_label(record.scope, labels)
        self.result_list = page


class EndpointFilter(admin.SimpleListFilter):
    title = _("endpoint")
    parameter_name = "endpoint"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        self.regexes = {endpoint.route: endpoint.regex for endpoint in idempotent_endpoints()}
        return [(route, route) for route in self.regexes]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value not in self.regexes:
            raise IncorrectLookupParameters(value)
        return queryset.filter(path__regex=self.regexes[value])


class MethodFilter(admin.SimpleListFilter):
    title = _("method")
    parameter_name = "method"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        methods = set(conf.METHODS).union(*(e.methods for e in idempotent_endpoints()))
        methods.add(IdempotencyRecord.CONSUMER_METHOD)  # exactly-once consumers' records
        return [(method, method) for method in sorted(methods)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(method=value.upper())


class ResponseStatusFilter(admin.SimpleListFilter):
    # 5xx responses are never stored: they roll back with the view's transaction.
    title = _("response status")
    parameter_name = "response"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("2xx", gettext("2xx success")),
            ("3xx", gettext("3xx redirect")),
            ("4xx", gettext("4xx client error")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value not in ("2xx", "3xx", "4xx"):
            raise IncorrectLookupParameters(value)
        low = int(value[0]) * 100
        return queryset.filter(response_code__gte=low, response_code__lt=low + 100)


def _record_days(using: str) -> list[date]:
    """Days that can hold records, newest first: the attached partitions on PostgreSQL,
    else the retention period."""
    today = catalog.utc_today()
    connection = connections[using]
    if connection.vendor == "postgresql":
        found = catalog.list_partitions(connection, RECORDS)
        named = (RECORDS.partition_day(p.name) for p in found if p.attached)
        days = {day for day in named if day is not None}
    else:
        retention = conf.MAX_TTL + conf.EXPIRED_WINDOW
        days = {today - timedelta(days=n) for n in range(retention.days + 2)}
    return sorted((day for day in days if day <= today), reverse=True)


class CreatedFilter(admin.SimpleListFilter):
    """Time ranges that PostgreSQL prunes to the partitions they cover."""

    title = _("created")
    parameter_name = "created"
    recent = {"1h": timedelta(hours=1), "24h": timedelta(hours=24)}

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        using = model_admin.get_queryset(request).db
        return [
            ("1h", gettext("Last hour")),
            ("24h", gettext("Last 24 hours")),
            *((day.isoformat(), date_format(day)) for day in _record_days(using)),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value in self.recent:
            return queryset.filter(created_at__gte=timezone.now() - self.recent[value])
        try:
            start, end = catalog.day_bounds(date.fromisoformat(value))
        except ValueError as exc:
            raise IncorrectLookupParameters(value) from exc
        return queryset.filter(created_at__gte=start, created_at__lt=end)


def _pre(text: str) -> SafeString:
    return format_html('<pre style="white-space: pre-wrap">{}</pre>', text)


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyLargeTableAdmin[IdempotencyRecord]):
    detail_only_fields = DETAIL_ONLY_FIELDS
    list_display = (
        "key",
        "principal",
        "method",
        "path",
        "response_code",
        "response_version",
        "created",
        "expires",
    )
    created = time_column("created_at", _("created at"))
    expires = time_column("expires_at", _("expires at"))
    # Erasure is the one bulk action (delete_selected is not offered).
    actions: Any = ("erase_principals",)
    list_filter = (CreatedFilter, ResponseStatusFilter, MethodFilter, EndpointFilter)
    search_fields = ("key",)
    search_help_text = _("The exact Idempotency-Key, as the client sent it, or a username.")
    readonly_fields = (
        "key",
        "principal",
        "method",
        "path",
        "fingerprint_parts",
        "response_code",
        "storage",
        "body_size",
        "body_digest",
        "response_headers_list",
        "body",
        "response_headers_masked",
        "body_redacted",
        "response_version",
        "status",
        "created_at",
        "expires_at",
    )

    def get_fieldsets(self, request: HttpRequest, obj: IdempotencyRecord | None = None) -> Any:
        # The stored headers and body only with the permission; others see them masked.
        # No digest of the body either: a digest is a test for a guess of the body.
        shown = (
            ("body_digest", "response_headers_list", "body")
            if responses.may_read(request)
            else ("response_headers_masked", "body_redacted")
        )
        return (
            (
                _("Request"),
                {"fields": ("key", "principal", "method", "path", "fingerprint_parts")},
            ),
            (
                _("Response"),
                {"fields": ("response_code", "storage", "body_size", *shown)},
            ),
            (
                _("Lifetime"),
                {"fields": ("response_version", "status", "created_at", "expires_at")},
            ),
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RecordChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord], search_term: str
    ) -> tuple[QuerySet[IdempotencyRecord], bool]:
        # Exact and case-sensitive, as keys are compared: search_fields' "=key" would be
        # UPPER(key) = UPPER(...), which no index serves.
        term = search_term.strip()
        if not term:
            return queryset, False
        with contextlib.suppress(InvalidKey):  # then no record has it: it finds nothing
            term = parse_key(term)
        found = Q(key=term)
        # A support person knows the customer's username, the records the principal.
        principals = principals_of_username(term)
        if principals:
            found |= Q(scope__in=principals)
        return queryset.filter(found), False

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 names where the actions show (and warns about an override that does not
        # take it); earlier versions pass nothing.
        if action_location is None:
            actions = super().get_actions(request)
        else:
            actions = super().get_actions(request, action_location=action_location)  # type: ignore[call-arg, unused-ignore]
        # Deleting frees a key; it is done one record at a time, from its page.
        actions.pop("delete_selected", None)
        return actions

    @admin.action(
        permissions=["delete"],
        description=_("Erase every record of the selected records' principals"),
    )
    def erase_principals(self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]) -> None:
        if request.POST.get("select_across") == "1":
            # Every principal of a large table would take a scan: erase by principal instead.
            self.message_user(
                request,
                gettext("Select records on this page, or run manage.py idempotency_erase."),
                messages.ERROR,
            )
            return
        scopes = set(queryset.values_list("scope", flat=True))
        principals = sorted(p for p in scopes if not p.startswith(TOMBSTONE_PREFIX))
        erased, incomplete = 0, 0
        for principal in principals:
            try:
                erased += erase(queryset.db, principal, batch=BATCH, wait=ADMIN_ERASE_WAIT)
            except ErasureIncomplete as exc:
                erased += exc.erased
                incomplete += 1
        if incomplete:
            self.message_user(
                request,
                # Two counts, two sentences: each takes the plural of its own number.
                ngettext("Erased %(count)d record.", "Erased %(count)d records.", erased)
                % {"count": erased}
                + " "
                + ngettext(
                    "For %(incomplete)d principal, requests in flight when the erasure began "
                    "were still running: what they commit is not erased. Erase again, or run "
                    "manage.py idempotency_erase.",
                    "For %(incomplete)d principals, requests in flight when the erasure began "
                    "were still running: what they commit is not erased. Erase again, or run "
                    "manage.py idempotency_erase.",
                    incomplete,
                )
                % {"incomplete": incomplete},
                messages.ERROR,
            )
            return
        self.message_user(
            request,
            ngettext("Erased %(count)d record", "Erased %(count)d records", erased)
            % {"count": erased}
            + " "
            + ngettext(
                "of %(principals)d principal.", "of %(principals)d principals.", len(principals)
            )
            % {"principals": len(principals)},
        )

    # Deleting frees a key; it is done one record at a time, from its page.
    def delete_model(self, request: HttpRequest, obj: IdempotencyRecord) -> None:
        records.delete(obj._state.db, record_id=obj.pk, created_at=obj.created_at)

    @admin.display(description=_("principal"))
    def principal(self, obj: IdempotencyRecord) -> str:
        label: str | None = getattr(obj, "principal_label", None)
        if label is None:  # the record's own page
            label = _principal_label(obj.scope, conf.PRINCIPAL_DISPLAY([obj.scope]))
        return label

    @admin.display(description=_("request fingerprint"))
    def fingerprint_parts(self, obj: IdempotencyRecord) -> SafeString:
        parts = obj.fingerprint or {}
        names = [*(p for p in PARTS if p in parts), *sorted(set(parts) - set(PARTS))]
        rows = format_html_join(
            "",
            "<tr><th>{}</th><td><code>{}</code></td></tr>",
            ((name, parts[name]) for name in names),
        )
        return format_html("<table>{}</table>", rows)

    @admin.display(description=_("stored"))
    def storage(self, obj: IdempotencyRecord) -> str:
        return responses.encoding_label(obj.body_encoding)

    @admin.display(description=_("body size"))
    def body_size(self, obj: IdempotencyRecord) -> str:
        shown = _shown(obj)
        stored = ngettext(
            "%(stored)d byte stored", "%(stored)d bytes stored", shown.stored_bytes
        ) % {"stored": shown.stored_bytes}
        if shown.unreadable:
            return stored
        sent = ngettext("%(sent)d byte as sent", "%(sent)d bytes as sent", len(shown.body)) % {
            "sent": len(shown.body)
        }
        return f"{sent}, {stored}"

    @admin.display(description=_("body digest"))
    def body_digest(self, obj: IdempotencyRecord) -> str:
        shown = _shown(obj)
        return shown.unreadable or shown.digest(obj._state.db or "default")

    @admin.display(description=_("response headers"))
    def response_headers_list(self, obj: IdempotencyRecord) -> SafeString:
        return _pre(responses.headers_text(_shown(obj).headers, full=True))

    @admin.display(description=_("response body"))
    def body(self, obj: IdempotencyRecord) -> SafeString:
        shown = _shown(obj)
        return _pre(shown.unreadable or responses.body_text(shown.body, full=True))

    @admin.display(description=_("response headers (values masked)"))
    def response_headers_masked(self, obj: IdempotencyRecord) -> SafeString:
        return _pre(responses.headers_text(_shown(obj).headers, full=False))

    @admin.display(description=_("response body (fields shown)"))
    def body_redacted(self, obj: IdempotencyRecord) -> SafeString:
        shown = _shown(obj)
        return _pre(shown.unreadable or responses.body_text(shown.body, full=False))


def _shown(obj: IdempotencyRecord) -> responses.Shown:
    # Opened once per page: a sealed body may be megabytes.
    shown: responses.Shown | None = getattr(obj, "_shown", None)
    if shown is None:
        shown = responses.opened(obj)
        obj._shown = shown  # type: ignore[attr-defined]
    return shown
