"""The ledger posting as a task of Django's Tasks framework, for a project whose
``PAYMENTS_LEDGER`` is ``"tasks"``: enqueued through the outbox backend
(``TASKS["default"]``), handed by the relay to the real backend as the package's
``task_runner.deliver``, which runs it once per outbox message id."""

from __future__ import annotations

from typing import Any

from django_idempotency.messaging.tasks_framework import TaskContext, task
from testproject.payments import ledger


@task(takes_context=True)
def post_ledger_entry(
    context: TaskContext[..., Any], charge_id: int, amount: int, currency: str, **switches: Any
) -> dict[str, Any]:
    """Post a charge to the ledger (``ledger.post_ledger_entry``; ``switches``: its faults)."""
    # The context is deliver's, whose first argument is the outbox message id (docs/outbox.md,
    # "Django's Tasks framework"): the id the ledger row names, as the Celery task's id does.
    message_id = str(context.task_result.args[0])
    return ledger.post_ledger_entry(message_id, charge_id, amount, currency, **switches)
