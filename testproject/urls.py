from __future__ import annotations

from importlib.util import find_spec

from django.conf import settings
from django.contrib import admin
from django.urls import include, path

# The API answers JSON even for a URL it has no route for (/api/charges/-1/).
handler404 = "testproject.payments.views.not_found"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("testproject.payments.urls")),
    # The deployment probe (manage.py idempotency_probe): its run needs the probe token.
    path("idempotency/probe/", include("django_idempotency.probe.urls")),
]
if find_spec("ninja"):  # an optional extra, like DRF's
    from testproject.ninja_api import api

    urlpatterns.append(path("ninja/", api.urls))
if settings.SPECTACULAR:
    from drf_spectacular.views import SpectacularAPIView

    urlpatterns.append(path("api/schema/", SpectacularAPIView.as_view(), name="schema"))
