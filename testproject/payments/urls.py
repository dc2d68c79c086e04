from __future__ import annotations

from django.urls import path

from testproject.payments import chain, views
from testproject.payments.models import Charge, Refund

app_name = "payments"

urlpatterns = [
    path("charges/", views.ChargeCreateView.as_view(), name="charges"),
    path("charges/<int:pk>/", views.ChargeDetailView.as_view(), name="charge-detail"),
    path("charges/count/", views.PaymentCountView.as_view(model=Charge), name="charge-count"),
    path("charges/chain/", chain.ChainCountView.as_view(), name="charge-chain"),
    path("webhooks/processor/", chain.processor_webhook, name="processor-webhook"),
    path("charges-plain/", views.PaymentCreateView.as_view(), name="charges-plain"),
    path("charges-django/", views.charge_without_drf, name="charges-django"),
    path("charges/async/", views.charge_async, name="charges-async"),
    path("charges/adrf/", views.AsyncChargeCreateView.as_view(), name="charges-adrf"),
    path("receipts/", views.ReceiptCreateView.as_view(), name="receipts"),
    path("receipts-plain/", views.ReceiptPlainView.as_view(), name="receipts-plain"),
    path("refunds/", views.RefundCreateView.as_view(), name="refunds"),
    path("refunds/count/", views.PaymentCountView.as_view(model=Refund), name="refund-count"),
]
