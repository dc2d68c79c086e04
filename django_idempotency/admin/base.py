"""What both admins share: read-only pages over a large partitioned table, with the planner's
estimate for a count and the detail-only columns left out of the list."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.utils.formats import date_format
from django.utils.functional import cached_property
from django.utils.timezone import localtime

_ModelT = TypeVar("_ModelT", bound=Model)

if TYPE_CHECKING:
    from django.utils.functional import _StrOrPromise as StrOrPromise

    # Generic in django-stubs only; at runtime these take no type argument.
    AnyPaginator = Paginator[Any]
    ModelAdminOf = admin.ModelAdmin
else:
    AnyPaginator = Paginator

    class ModelAdminOf(Generic[_ModelT], admin.ModelAdmin):
        pass


class EstimatedCountPaginator(AnyPaginator):
    """Counts with the planner's estimate on PostgreSQL, where an exact ``COUNT(*)`` reads
    every row of every partition. Small results are counted exactly: that is cheap, worth
    showing, and keeps the changelist from fetching a whole result it believed was small."""

    # Larger than ModelAdmin.list_max_show_all, so "Show all" only ever lists exact counts.
    exact_below = 1000
    estimated = False

    @cached_property
    def count(self) -> int:
        queryset: QuerySet[Any] = self.object_list  # type: ignore[assignment]
        if connections[queryset.db].vendor != "postgresql":
            return super().count
        unordered = queryset.order_by()
        plan = json.loads(unordered.explain(format="json"))
        estimate = int(plan[0]["Plan"]["Plan Rows"])
        if estimate < self.exact_below:
            exact = unordered[: self.exact_below].count()
            if exact < self.exact_below:
                return exact
        self.estimated = True
        return max(estimate, self.exact_below)


class DetailDeferringChangeList(ChangeList):
    """A list that never loads the columns only the detail page shows
    (the model admin's ``detail_only_fields``)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset = super().get_queryset(request, exclude_parameters)
        detail_only: tuple[str, ...] = getattr(self.model_admin, "detail_only_fields", ())
        return queryset.defer(*detail_only)


class ReadOnlyLargeTableAdmin(ModelAdminOf[_ModelT]):
    """Pages that add and change nothing, over a table too large to count, sort or facet:
    no bulk action, 50 rows a page."""

    # Columns the list never shows (DetailDeferringChangeList leaves them out).
    detail_only_fields: tuple[str, ...] = ()
    # Newest first from the primary key index of each partition, merged; the other
    # columns have no index to sort by.
    ordering = ("-id",)
    sortable_by = ()
    list_per_page = 50
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    class Media:
        # Long keys, principals and paths keep one line: the lists fit 1,280 px.
        css = {"all": ("django_idempotency/admin/lists.css",)}

    show_facets = admin.ShowFacets.NEVER
    actions = None

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return DetailDeferringChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: _ModelT | None = None) -> bool:
        return False


def time_column(field: str, description: StrOrPromise) -> Callable[[Any, Any], str]:
    """A list column showing ``field`` as 2026-11-27 09:54:12 (current time zone): two short
    lines where the locale's long format took three and pushed the last columns away."""

    @admin.display(description=description)
    def column(admin_: Any, obj: Any) -> str:
        value = getattr(obj, field)
        return "-" if value is None else date_format(localtime(value), "Y-m-d H:i:s")

    return column


def exact_id_search(queryset: QuerySet[_ModelT], search_term: str) -> QuerySet[_ModelT]:
    """The row whose UUID primary key is ``search_term``: one index probe per partition."""
    term = search_term.strip()
    if not term:
        return queryset
    try:
        row_id = uuid.UUID(term)
    except ValueError:  # no row has it; the nil UUID is nobody's (none() has no plan)
        row_id = uuid.UUID(int=0)
    return queryset.filter(id=row_id)
