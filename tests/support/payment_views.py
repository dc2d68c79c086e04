"""Test views over the payments app's models, for settings that install it (``tests.support.urls``
adds them only then)."""

from __future__ import annotations

from rest_framework import viewsets
from rest_framework.authentication import TokenAuthentication
from rest_framework.permissions import IsAuthenticated

from django_idempotency.rest_framework import IdempotencyMixin
from testproject.payments.models import Charge
from testproject.payments.serializers import ChargeDescriptionSerializer
from testproject.payments.views import IsOwner
from tests.support.views import CALLS


class ChargeViewSet(IdempotencyMixin, viewsets.ModelViewSet[Charge]):
    """Token-authenticated charges, owner only, with DELETE covered too."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated, IsOwner]
    serializer_class = ChargeDescriptionSerializer
    queryset = Charge.objects.all()
    idempotency_methods = ["POST", "PATCH", "DELETE"]

    def perform_destroy(self, instance: Charge) -> None:
        CALLS.hit(f"destroy:{instance.pk}")
        instance.delete()
