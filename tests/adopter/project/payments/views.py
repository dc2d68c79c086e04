import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from rest_framework import serializers, status, viewsets
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency.decorators import idempotent
from django_idempotency.rest_framework import IdempotencyMixin
from payments.api_keys import api_client, require_api_key
from payments.models import Event, Invoice, Transfer
from payments.tasks import post_ledger_entry_later


class InvoiceSerializer(serializers.ModelSerializer):
    class Meta:
        model = Invoice
        fields = ["id", "amount", "currency", "status"]
        read_only_fields = ["status"]


class InvoiceViewSet(IdempotencyMixin, viewsets.ModelViewSet):
    serializer_class = InvoiceSerializer
    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [IsAuthenticated]
    # PUT and DELETE too: each writes an audit event the team wants once per key.
    idempotency_methods = ["POST", "PUT", "PATCH", "DELETE"]

    def get_queryset(self):
        return Invoice.objects.filter(owner=self.request.user).order_by("pk")

    def perform_create(self, serializer):
        invoice = serializer.save(owner=self.request.user)
        Event.objects.create(kind="invoice.created", ref=invoice.pk)
        post_ledger_entry_later(invoice.pk, "created", invoice.amount)

    def perform_update(self, serializer):
        invoice = serializer.save()
        partial = serializer.partial
        Event.objects.create(
            kind="invoice.patched" if partial else "invoice.updated", ref=invoice.pk
        )

    def perform_destroy(self, instance):
        Event.objects.create(kind="invoice.deleted", ref=instance.pk)
        instance.delete()

    @action(detail=True, methods=["post"])
    def pay(self, request: Request, pk: str | None = None) -> Response:
        invoice = self.get_object()
        if invoice.status == "paid":
            return Response({"detail": "already paid"}, status=status.HTTP_409_CONFLICT)
        invoice.status = "paid"
        invoice.save(update_fields=["status"])
        Event.objects.create(kind="invoice.paid", ref=invoice.pk)
        post_ledger_entry_later(invoice.pk, "paid", invoice.amount)
        return Response(InvoiceSerializer(invoice).data, status=status.HTTP_201_CREATED)


# The API key is checked first, then the key is claimed under the partner's own scope.
@csrf_exempt
@require_POST
@require_api_key
@idempotent(required=True, principal=api_client)
def create_transfer(request: HttpRequest) -> JsonResponse:
    try:
        amount = int(json.loads(request.body)["amount"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"detail": "amount is required"}, status=400)
    transfer = Transfer.objects.create(client=request.api_client, amount=amount)
    Event.objects.create(kind="transfer.created", ref=transfer.pk)
    return JsonResponse({"id": transfer.pk, "amount": amount}, status=201)
