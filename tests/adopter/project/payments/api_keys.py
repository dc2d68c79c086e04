"""The team's own API-key authentication for partner endpoints (no DRF there)."""

from collections.abc import Callable
from functools import wraps

from django.http import HttpRequest, HttpResponse, JsonResponse

from payments.models import ApiClient


def require_api_key(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    @wraps(view)
    def wrapper(request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        key = request.headers.get("X-Api-Key", "")
        client = ApiClient.objects.filter(key=key).first() if key else None
        if client is None:
            return JsonResponse({"detail": "a valid X-Api-Key is required"}, status=401)
        request.api_client = client  # type: ignore[attr-defined]
        return view(request, *args, **kwargs)

    return wrapper


def api_client(request: HttpRequest) -> ApiClient:
    """The principal of a keyed request: the partner, so partners never share keys."""
    return request.api_client  # type: ignore[attr-defined,no-any-return]
