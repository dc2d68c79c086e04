"""Read-only admins for the records, the outbox and the CDC events that stay fast on large
partitioned tables: every query bounded (no full ``COUNT(*)``, no ``SELECT DISTINCT``, exact
search, newest first from the primary key index); and the relays' heartbeats. Importing the
package registers them."""

from django_idempotency.admin.base import (
    DetailDeferringChangeList,
    EstimatedCountPaginator,
    ReadOnlyLargeTableAdmin,
)
from django_idempotency.admin.events import OutboxEventAdmin
from django_idempotency.admin.outbox import OutboxMessageAdmin
from django_idempotency.admin.records import IdempotencyRecordAdmin, usernames
from django_idempotency.admin.relays import RelayHeartbeatAdmin

__all__ = [
    "DetailDeferringChangeList",
    "EstimatedCountPaginator",
    "IdempotencyRecordAdmin",
    "OutboxEventAdmin",
    "OutboxMessageAdmin",
    "ReadOnlyLargeTableAdmin",
    "RelayHeartbeatAdmin",
    "usernames",
]
