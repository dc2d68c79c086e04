"""URLs of the test-only views (``@pytest.mark.urls("tests.support.urls")``)."""

from __future__ import annotations

from datetime import timedelta
from importlib.util import find_spec

from django.apps import apps
from django.urls import include, path
from rest_framework.routers import SimpleRouter

from tests.support import views

router = SimpleRouter()
router.register("groups", views.GroupViewSet)
if apps.is_installed("testproject.payments"):
    from tests.support.payment_views import ChargeViewSet

    router.register("charges", ChargeViewSet)

urlpatterns = [
    path("drf/", views.ScriptedView.as_view(), name="drf"),
    path("drf/other/", views.ScriptedView.as_view(), name="drf-other"),
    path("drf/required/", views.ScriptedView.as_view(idempotency_required=True)),
    path("drf/put-only/", views.ScriptedView.as_view(idempotency_methods=["PUT"])),
    path("drf/ttl-long/", views.ScriptedView.as_view(idempotency_ttl=timedelta(days=30))),
    path("drf/ttl-short/", views.ScriptedView.as_view(idempotency_ttl=timedelta(hours=1))),
    path(
        "drf/excluding/",
        views.ScriptedView.as_view(idempotency_exclude_fields=["client_ts", "meta.sent_at"]),
    ),
    path(
        "drf/header-fingerprint/",
        views.ScriptedView.as_view(idempotency_fingerprint_headers=["X-Account"]),
    ),
    path("drf/tenant/", views.ScriptedView.as_view(idempotency_principal=views.tenant_principal)),
    path("drf/lookup-first/", views.ScriptedView.as_view(idempotency_lookup_first=True)),
    path("drf/claim-first/", views.ScriptedView.as_view(idempotency_lookup_first=False)),
    path("drf/no-wait/", views.ScriptedView.as_view(idempotency_wait=timedelta(0))),
    path("drf/guarded/", views.GuardedView.as_view()),
    path(
        "drf/rerun-versions/",
        views.GuardedView.as_view(
            idempotency_response_version="2", idempotency_rerun_other_versions=True
        ),
    ),
    path("drf/upload/", views.Upload.as_view()),
    path("drf/traced/", views.TracedView.as_view()),
    path("drf/negotiated/", views.NegotiatedView.as_view()),
    path("drf/json-only/", views.JSONOnlyView.as_view()),
    path("drf/durable/", views.DurableView.as_view()),
    path("drf/api-view/", views.api_view_charge),
    path("drf/api-view/negotiated/", views.api_view_negotiated),
    path("drf/api-view/identified/", views.api_view_identified),
    path("drf/", include(router.urls)),
    path("adrf/", views.AsyncScriptedView.as_view()),
    path("plain/", views.plain),
    path("plain/identified/", views.plain_identified),
    path("plain/other/", views.plain),
    path("plain/required/", views.plain_required),
    path("plain/put-only/", views.plain_put_only),
    path("plain/tenant/", views.plain_tenant),
    path("plain/excluding/", views.plain_excluding),
    path("plain/login/", views.plain_login_required),
    path("plain/anonymous-keys/", views.plain_anonymous_keys),
    path("drf/token-only/", views.TokenOnlyView.as_view()),
    path("drf/anonymous-keys/", views.AnonymousKeysView.as_view()),
    path("drf/identified/", views.ScriptedView.as_view(idempotency_allow_anonymous=False)),
    path("iban/above-token-required/", views.iban_above_token_required),
    path("api-key/above/", views.api_key_above),
    path("api-key/scoped/", views.api_key_scoped),
    path("iban/above-api-view/", views.iban_above_api_view),
    path("iban/below-token-required/", views.iban_below_token_required),
    path("iban/below-api-view/", views.iban_below_api_view),
    path("cbv/method-decorated/", views.MethodDecoratedView.as_view()),
    path("drf/method-decorated/", views.MethodDecoratedAPIView.as_view()),
    path("drf/dispatch-decorated/", views.DispatchDecoratedView.as_view()),
    path("cbv/dispatch-decorated/", views.DispatchDecoratedPlainView.as_view()),
    path("plain/json-only/", views.plain_json_only),
    path("idempotency/probe/", include("django_idempotency.probe.urls")),
]
if find_spec("ninja"):  # an optional extra
    from tests.support.ninja_views import api

    urlpatterns.append(path("ninja/", api.urls))
