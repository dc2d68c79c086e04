from __future__ import annotations

from django.conf import settings
from django.db import models


class Payment(models.Model):
    """A movement of money: an amount in the currency's smallest unit, owned by a user."""

    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.amount} {self.currency.upper()}"


class Charge(Payment):
    description = models.CharField(max_length=255, blank=True, default="")


class Refund(Payment):
    pass


class FaultTag(models.Model):
    """A ``fail_once`` / ``crash_once`` tag already seen, written outside request transactions."""

    tag = models.CharField(max_length=255, unique=True)
    seen_at = models.DateTimeField()

    def __str__(self) -> str:
        return self.tag


class LedgerEntry(models.Model):
    """A charge posted to the ledger by the exactly-once task ``post_ledger_entry``.

    Deliberately without a unique constraint on the charge: a duplicate posting must show
    up as a second row, which is what the tests and the demo count.
    """

    charge = models.ForeignKey(Charge, on_delete=models.PROTECT, related_name="+")
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    # The outbox message that posted it (the Celery task id, the Nats-Msg-Id, the id
    # task_runner.deliver carries).
    message_id = models.CharField(max_length=64)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"ledger {self.amount} {self.currency.upper()} for charge {self.charge_id}"


class Capture(models.Model):
    """The processor's capture of a charge, written in the charge's own transaction."""

    charge = models.OneToOneField(Charge, on_delete=models.PROTECT, related_name="+")
    # The processor's id, which its webhooks name.
    capture_id = models.CharField(max_length=64, unique=True)

    def __str__(self) -> str:
        return f"{self.capture_id} for charge {self.charge_id}"


class Settlement(models.Model):
    """A charge marked settled by the processor's webhook; no unique constraint either."""

    charge = models.ForeignKey(Charge, on_delete=models.PROTECT, related_name="+")
    # The processor's delivery id (its webhook-id header).
    delivery = models.CharField(max_length=255)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"settlement of charge {self.charge_id}"
