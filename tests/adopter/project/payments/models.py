from django.conf import settings
from django.db import models


class Invoice(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=10, default="open")

    def __str__(self) -> str:
        return f"invoice {self.pk}: {self.amount} {self.currency}"


class ApiClient(models.Model):
    """A partner that calls the transfers endpoint with its own X-Api-Key."""

    name = models.CharField(max_length=50, unique=True)
    key = models.CharField(max_length=64, unique=True)

    def __str__(self) -> str:
        return self.name


class Transfer(models.Model):
    client = models.ForeignKey(ApiClient, on_delete=models.CASCADE)
    amount = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"transfer {self.pk}"


class Event(models.Model):
    """One row per execution of a request's effect: how the team counts 'exactly once'."""

    kind = models.CharField(max_length=40)
    ref = models.BigIntegerField()

    def __str__(self) -> str:
        return f"{self.kind} {self.ref}"


class LedgerEntry(models.Model):
    """Written by the worker, once per outbox message."""

    invoice = models.BigIntegerField()
    kind = models.CharField(max_length=20)
    amount = models.IntegerField()

    def __str__(self) -> str:
        return f"ledger {self.kind} {self.invoice}"
