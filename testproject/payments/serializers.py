from __future__ import annotations

from typing import Any

from rest_framework import serializers

from testproject.payments.models import Charge, Payment, Refund


class PaymentSerializer(serializers.ModelSerializer[Payment]):
    user = serializers.ReadOnlyField(source="user.username")

    class Meta:
        fields = ["id", "amount", "currency", "user", "created"]
        read_only_fields = ["id", "created"]
        # Amounts are in the currency's smallest unit, like Stripe's: 2499 is 24.99.
        extra_kwargs: dict[str, dict[str, Any]] = {"amount": {"min_value": 1}}

    def validate_currency(self, value: str) -> str:
        if not (len(value) == 3 and value.isascii() and value.isalpha()):
            raise serializers.ValidationError("Use a three-letter ISO 4217 code, such as inr.")
        return value.lower()


class ChargeSerializer(PaymentSerializer):
    class Meta(PaymentSerializer.Meta):
        model = Charge
        fields = [*PaymentSerializer.Meta.fields, "description"]


class ChargeDescriptionSerializer(serializers.ModelSerializer[Charge]):
    """What a charge's owner may change after the fact: its description."""

    user = serializers.ReadOnlyField(source="user.username")

    class Meta:
        model = Charge
        fields = ["id", "amount", "currency", "user", "created", "description"]
        read_only_fields = ["id", "amount", "currency", "created"]


class RefundSerializer(PaymentSerializer):
    class Meta(PaymentSerializer.Meta):
        model = Refund


# Receipts outside these bounds are refused (400). The least leaves room for the charge
# itself, whose longest user name (150 characters of up to 4 bytes) takes about 700.
RECEIPT_MIN_BYTES = 1024
RECEIPT_MAX_BYTES = 2 * 1024 * 1024


class ReceiptSerializer(PaymentSerializer):
    """A charge, and how many bytes of JSON its receipt should take."""

    size = serializers.IntegerField(
        write_only=True,
        min_value=RECEIPT_MIN_BYTES,
        max_value=RECEIPT_MAX_BYTES,
        help_text="The receipt's size in bytes, exactly: whole lines, then padding.",
    )

    class Meta(PaymentSerializer.Meta):
        model = Charge
        fields = [*PaymentSerializer.Meta.fields, "size"]

    def create(self, validated_data: dict[str, Any]) -> Payment:
        validated_data.pop("size", None)
        return super().create(validated_data)


class ReceiptAnswerSerializer(serializers.Serializer[dict[str, Any]]):
    """What ``ReceiptCreateView`` answers (receipts.receipt()); declared for the schema."""

    charge = ReceiptSerializer()
    lines = serializers.ListField(child=serializers.CharField())
    padding = serializers.CharField(help_text="Spaces: the receipt's size, exactly.")


class PaymentCountSerializer(serializers.Serializer[dict[str, Any]]):
    """What ``PaymentCountView`` answers; declared so the OpenAPI schema describes it."""

    executions = serializers.IntegerField(
        allow_null=True, help_text="Runs of the handler, rolled back ones included (PostgreSQL)."
    )
    rows = serializers.IntegerField(help_text="Payments committed.")


class ChainCountSerializer(serializers.Serializer[dict[str, Any]]):
    """What ``ChainCountView`` answers; declared so the OpenAPI schema describes it."""

    charges = serializers.IntegerField()
    captures = serializers.IntegerField(
        allow_null=True, help_text="Captures at the payment processor; null if unreachable."
    )
    ledger_rows = serializers.IntegerField()
    settlements = serializers.IntegerField()
    outbox_backlog = serializers.IntegerField(help_text="Outbox messages not yet published.")
    dead_letters = serializers.IntegerField(
        help_text="Outbox messages that failed to publish too often, waiting to be requeued."
    )
    relay_owner = serializers.CharField(
        allow_null=True, help_text="The relay that beat last; null if no relay has beaten."
    )
    relay_heartbeat_age = serializers.FloatField(
        allow_null=True,
        help_text="Seconds since that relay's last heartbeat (it beats every 5 s while it runs).",
    )
