from django.urls import include, path
from rest_framework.routers import DefaultRouter

from payments.views import InvoiceViewSet, create_transfer

router = DefaultRouter()
router.register("invoices", InvoiceViewSet, basename="invoice")

urlpatterns = [
    path("api/", include(router.urls)),
    path("transfers/", create_transfer),
    path("idempotency/probe/", include("django_idempotency.probe.urls")),
]
