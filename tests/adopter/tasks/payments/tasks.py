from django.tasks import task
from payments.models import LedgerEntry


@task
def post_ledger_entry(invoice: int, kind: str, amount: int) -> dict[str, int]:
    entry = LedgerEntry.objects.create(invoice=invoice, kind=kind, amount=amount)
    return {"entry": entry.pk}


def post_ledger_entry_later(invoice: int, kind: str, amount: int) -> None:
    """In the request's transaction: handed to the worker if and only if it commits."""
    post_ledger_entry.enqueue(invoice, kind, amount)
