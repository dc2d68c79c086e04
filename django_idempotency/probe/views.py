"""The probe's two views: ``run/`` executes a probe key, ``report/`` says what this server
sees. Mount them with ``include("django_idempotency.probe.urls")``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from functools import wraps
from typing import Any

from django.db import router, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from django_idempotency.conf import conf
from django_idempotency.decorators import idempotent
from django_idempotency.http.request import is_probe_token
from django_idempotency.models import IdempotencyRecord, ProbeRow
from django_idempotency.probe.facts import SERVER, server_facts

View = Callable[..., HttpResponse]
# Old probe rows go a few at a time, on the probe's own runs.
EXPIRE_BATCH = 100


def records_database(request: HttpRequest | None = None) -> str:
    """Where the records go: the probe's writes must share their transaction."""
    return router.db_for_write(IdempotencyRecord)


def _token_matches(request: HttpRequest) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme == "Bearer" and is_probe_token(given.strip())


def _refused(request: HttpRequest) -> HttpResponse:
    detail = (
        "Send Authorization: Bearer <IDEMPOTENCY_PROBE_TOKEN>."
        if conf.PROBE_TOKEN
        else "Set IDEMPOTENCY_PROBE_TOKEN to run the probe; staff users may read the report."
    )
    return JsonResponse({"detail": detail}, status=403)


def token_required(view: View) -> View:
    """The probe token, nothing else: a run writes, and a session could be made to POST."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return view(request, *args, **kwargs) if _token_matches(request) else _refused(request)

    return wrapper


def staff_or_token(view: View) -> View:
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = getattr(request, "user", None)
        if _token_matches(request) or (user is not None and user.is_staff):
            return view(request, *args, **kwargs)
        return _refused(request)

    return wrapper


def _probe_principal(request: HttpRequest) -> str:
    return "probe"


@csrf_exempt
@require_POST
@token_required
@idempotent(principal=_probe_principal, using=records_database, required=True)
def run(request: HttpRequest) -> HttpResponse:
    """One execution of the probe key: a row in the claim's transaction."""
    using = records_database()
    key = request.headers.get(conf.HEADER, "")[:255]
    old = ProbeRow.objects.using(using).filter(created_at__lt=timezone.now() - conf.MAX_TTL)
    expired = list(old.values_list("pk", flat=True)[:EXPIRE_BATCH])
    if expired:
        ProbeRow.objects.using(using).filter(pk__in=expired).delete()
    row = ProbeRow.objects.using(using).create(key=key, server=SERVER)
    return JsonResponse({"key": key, "server": SERVER, "row": row.pk}, status=201)


@transaction.non_atomic_requests  # the pooler fact begins and ends transactions of its own
@require_GET
@staff_or_token
def report(request: HttpRequest) -> HttpResponse:
    """This server's facts; with ``?key=``, how many times that probe key executed."""
    using = records_database()
    body: dict[str, Any] = {
        "server": SERVER,
        "facts": [asdict(fact) for fact in server_facts(using)],
    }
    if key := request.GET.get("key"):
        body["executions"] = ProbeRow.objects.using(using).filter(key=key[:255]).count()
    return JsonResponse(body)
