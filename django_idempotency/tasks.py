"""Celery task ``django_idempotency.maintain_partitions``: schedule it hourly with beat.

Celery is an optional extra; nothing else in the package imports this module.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from django_idempotency.beat import TASK_NAME
from django_idempotency.partitions.maintain import maintain


@shared_task(name=TASK_NAME)
def maintain_partitions(
    dry_run: bool = False, drop: bool | None = None, using: str | None = None
) -> dict[str, Any]:
    """Create upcoming partitions and drop expired ones of every partitioned table
    (elsewhere: delete expired rows)."""
    return maintain(using, dry_run=dry_run, drop=drop).as_dict()
