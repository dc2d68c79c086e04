"""System checks: ``django_idempotency.E0xx`` for settings, ``W0xx`` for the environment,
``E1xx``/``W1xx`` for the partitioned tables; one module per concern. Importing the package
registers them all."""

from django_idempotency.checks.cdc import check_cdc
from django_idempotency.checks.databases import check_databases, check_isolation, check_secret
from django_idempotency.checks.messaging import (
    check_consumers,
    check_destinations,
    check_outbox_backlog,
)
from django_idempotency.checks.partitions import check_partitions
from django_idempotency.checks.sealing import check_keys, check_plain_text
from django_idempotency.checks.servers import check_servers
from django_idempotency.checks.settings import check_beat, check_settings
from django_idempotency.checks.views import check_records_follow_writes, check_views

__all__ = [
    "check_beat",
    "check_cdc",
    "check_consumers",
    "check_databases",
    "check_destinations",
    "check_isolation",
    "check_keys",
    "check_outbox_backlog",
    "check_partitions",
    "check_plain_text",
    "check_records_follow_writes",
    "check_secret",
    "check_servers",
    "check_settings",
    "check_views",
]
