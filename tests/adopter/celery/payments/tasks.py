from celery import shared_task
from payments.models import LedgerEntry

from django_idempotency.messaging.consumers import ExactlyOnceTask
from django_idempotency.messaging.outbox import enqueue_task


@shared_task(base=ExactlyOnceTask, bind=True, name="payments.post_ledger_entry")
def post_ledger_entry(self, invoice: int, kind: str, amount: int) -> dict[str, int]:
    entry = LedgerEntry.objects.create(invoice=invoice, kind=kind, amount=amount)
    return {"entry": entry.pk}


def post_ledger_entry_later(invoice: int, kind: str, amount: int) -> None:
    """In the request's transaction: published if and only if it commits."""
    enqueue_task(post_ledger_entry, (invoice, kind, amount))
