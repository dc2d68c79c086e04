"""The payments API beyond its own database: the processor capture (with a downstream key),
the ledger posting (through the outbox to an exactly-once task), and the processor's
webhook (deduplicated by its delivery id, scoped to the sender that signed it).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.db import router
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.contrib.standard_webhooks import (
    ID_HEADER,
    verify_standard_webhook,
    webhook_principal,
)
from django_idempotency.decorators import idempotent
from django_idempotency.messaging.downstream import derive_key
from django_idempotency.messaging.outbox import enqueue_task
from django_idempotency.messaging.relay import heartbeats
from django_idempotency.models import OutboxMessage, RelayHeartbeat
from testproject import processor
from testproject.payments.models import Capture, Charge, LedgerEntry, Payment, Settlement
from testproject.payments.serializers import ChainCountSerializer
from testproject.payments.tasks import POST_LEDGER_ENTRY


def capture(data: Mapping[str, Any]) -> str | None:
    """Capture the charge at the processor; the capture's id, or None when no processor is
    configured."""
    url = getattr(settings, "PAYMENTS_PROCESSOR_URL", "")
    if not url:
        return None
    # The same request key gives the same processor key: a retry that runs this again
    # after a rollback (or a crash) is answered by the processor with the first capture.
    captured = processor.capture(
        url,
        key=derive_key("capture"),
        # Only what a re-execution sends again unchanged: the processor compares a repeated
        # key's parameters, and the charge's id is new on every run.
        amount=data["amount"],
        currency=data["currency"],
    )
    return str(captured["id"])


def post_to_ledger(
    payment: Payment, capture_id: str, switches: Mapping[str, Any] | None = None
) -> str:
    """Record the capture, and put the charge's ledger posting in the outbox: published by the
    relay if and only if this request commits, and posted once by the exactly-once task (a
    Celery task, or with ``PAYMENTS_LEDGER = "tasks"`` one of Django's Tasks framework).
    ``switches`` are the task's fault switches (the tests' and the demo's)."""
    Capture.objects.create(charge_id=payment.pk, capture_id=capture_id)
    args = (payment.pk, payment.amount, payment.currency)
    # The capture names the charge to the posting: the same in every run of this request,
    # where the charge's id is not (ledger.post_ledger_entry).
    kwargs = {"capture": capture_id, **(switches or {})}
    if getattr(settings, "PAYMENTS_LEDGER", "celery") == "tasks":
        # Imported here: Django's Tasks framework is an extra (the backport on Django 5.2).
        from testproject.payments.ledger_tasks import post_ledger_entry

        return str(post_ledger_entry.enqueue(*args, **kwargs).id)
    # Celery's by default; IDEMPOTENCY_OUTBOX_ROUTES may send it elsewhere (NATS).
    return enqueue_task(POST_LEDGER_ENTRY, args, kwargs)


def processor_secret() -> str:
    """The processor's signing secret, read on each delivery (override_settings works)."""
    return str(getattr(settings, "PAYMENTS_WEBHOOK_SECRET", ""))


@csrf_exempt
@require_POST
# Standard Webhooks: the signature covers webhook-id, the timestamp and the body, and is
# checked before the delivery id below is claimed; a delivery id is scoped to its sender.
@verify_standard_webhook(processor_secret, sender="processor")
@idempotent(key_header=ID_HEADER, principal=webhook_principal, required=True)
def processor_webhook(request: HttpRequest) -> HttpResponse:
    """The processor's events: ``charge.settled`` marks the charge settled, once per
    delivery id however often the processor delivers it."""
    try:
        event = json.loads(request.body)
        kind, data = event["type"], event["data"]
        # The processor names its capture; a charge id is accepted too.
        found = (
            Charge.objects.filter(pk=int(data["charge"]))
            if "charge" in data
            else Charge.objects.filter(
                pk__in=Capture.objects.filter(capture_id=str(data["capture"])).values("charge_id")
            )
        )
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"detail": "Not an event."}, status=400)
    if kind != "charge.settled":
        return JsonResponse({"ignored": kind})
    charge = found.first()
    if charge is None:
        # Perhaps captured by a request that has not committed yet: not stored (5xx), so
        # the processor's next delivery tries again.
        return JsonResponse({"detail": "Unknown charge; deliver again later."}, status=503)
    settlement = Settlement.objects.create(charge=charge, delivery=request.headers[ID_HEADER])
    return JsonResponse({"charge": charge.pk, "settled": True, "settlement": settlement.pk})


def processor_stats() -> dict[str, Any] | None:
    url = getattr(settings, "PAYMENTS_PROCESSOR_URL", "")
    if not url:
        return None
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/stats", timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats
    except (urllib.error.URLError, OSError, ValueError):
        return None


class ChainCountView(APIView):
    """The whole chain at a glance: charges, captures at the processor, ledger rows,
    settlements, the outbox backlog and dead letters, and the relay that beat last."""

    authentication_classes: list[type[Any]] = []
    permission_classes = [AllowAny]
    # Read by drf-spectacular for the response schema (APIView has no get_serializer).
    serializer_class = ChainCountSerializer

    def get(self, request: Request) -> Response:
        stats = processor_stats()
        relay = heartbeats.freshest(router.db_for_read(RelayHeartbeat))
        return Response(
            {
                "charges": Charge.objects.count(),
                "captures": None if stats is None else stats["captures"],
                "ledger_rows": LedgerEntry.objects.count(),
                "settlements": Settlement.objects.count(),
                "outbox_backlog": OutboxMessage.objects.filter(published_at__isnull=True).count(),
                "dead_letters": OutboxMessage.objects.filter(dead_at__isnull=False).count(),
                "relay_owner": None if relay is None else relay.owner,
                "relay_heartbeat_age": None if relay is None else round(heartbeats.age(relay), 1),
            }
        )
