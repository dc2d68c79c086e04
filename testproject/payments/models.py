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
