"""Standard Webhooks receivers (https://www.standardwebhooks.com): the signature checked by the
``standardwebhooks`` package (the ``webhooks`` extra) before the delivery's key is claimed.

    @csrf_exempt
    @require_POST
    @verify_standard_webhook(lambda: settings.SHOP_WEBHOOK_SECRET, sender="shop")
    @idempotent(key_header=ID_HEADER, principal=webhook_principal, required=True)
    def receive(request): ...

The signature covers ``webhook-id``, ``webhook-timestamp`` and the body, so the id the view
deduplicates on is the sender's own, and a captured delivery sent again under a new id, or
more than five minutes after it was signed, is refused here: a 4xx that claims no key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, JsonResponse

from django_idempotency.conf import conf
from django_idempotency.http.problems import PROBLEM_CONTENT_TYPE

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
HEADERS = (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)
WHSEC = "whsec_"  # how Standard Webhooks senders show a secret, before its base64
# Set on a verified request: who signed it, for ``webhook_principal``.
SENDER_ATTRIBUTE = "standard_webhook_sender"

V = TypeVar("V", bound=Callable[..., Any])


def verify_standard_webhook(secret: str | Callable[[], str], *, sender: str) -> Callable[[V], V]:
    """Refuse a delivery that ``sender`` did not sign with ``secret`` (``"whsec_…"``, or a
    function that returns it, read on each request), before anything below runs: 400 when a
    Standard Webhooks header is missing, 401 when the signature or its time does not verify.
    A verified request names its ``sender`` for ``webhook_principal``."""

    def decorator(view: V) -> V:
        if iscoroutinefunction(view):

            async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                refused = _refusal(request, secret, sender)
                return refused if refused is not None else await view(request, *args, **kwargs)

            markcoroutinefunction(async_wrapper)
            return cast("V", functools.wraps(view)(async_wrapper))

        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            refused = _refusal(request, secret, sender)
            return refused if refused is not None else view(request, *args, **kwargs)

        return cast("V", functools.wraps(view)(wrapper))

    return decorator


def webhook_principal(request: HttpRequest) -> str:
    """The principal of a verified delivery: its sender. Delivery ids are unique per sender
    only, so two senders' ids never meet."""
    sender = getattr(request, SENDER_ATTRIBUTE, None)
    if sender is None:
        raise ImproperlyConfigured(
            "webhook_principal() read a request that verify_standard_webhook() did not "
            "verify: put @verify_standard_webhook above @idempotent on the view."
        )
    return f"webhook:{sender}"


def _refusal(
    request: HttpRequest, secret: str | Callable[[], str], sender: str
) -> HttpResponse | None:
    # Imported here: standardwebhooks is an extra (django-idempotency[webhooks]).
    from standardwebhooks import Webhook
    from standardwebhooks.webhooks import WebhookVerificationError

    missing = [name for name in HEADERS if not request.headers.get(name)]
    if missing:
        return _problem(
            400,
            "webhook-headers-missing",
            "A Standard Webhooks header is missing",
            f"A delivery carries {', '.join(HEADERS)}; this one lacks {', '.join(missing)}.",
        )
    key = secret() if callable(secret) else secret
    try:
        # An empty secret is refused here: standardwebhooks 1.0 would sign with an empty key.
        if not key or not key.removeprefix(WHSEC):
            raise ValueError("empty")
        webhook = Webhook(key)
    except (ValueError, RuntimeError) as exc:  # ValueError: not base64
        raise ImproperlyConfigured(
            f"The Standard Webhooks secret for sender {sender!r} is unusable ({exc}): give "
            "verify_standard_webhook() the sender's signing secret as it shows it, "
            '"whsec_" and base64.'
        ) from None
    headers = {name: request.headers[name] for name in HEADERS}
    try:
        webhook.verify(request.body, headers, json_parse=False)
    except (WebhookVerificationError, ValueError) as exc:  # ValueError: a malformed header
        reason = str(exc) if isinstance(exc, WebhookVerificationError) else "malformed headers"
        return _problem(
            401,
            "webhook-signature-invalid",
            "The Standard Webhooks signature does not verify",
            f"The delivery was refused: {reason}. Nothing was run or stored.",
        )
    setattr(request, SENDER_ATTRIBUTE, sender)
    return None


def _problem(status: int, name: str, title: str, detail: str) -> JsonResponse:
    body = {"type": conf.PROBLEM_TYPE_BASE + name, "title": title, "status": status}
    body["detail"] = detail
    response = JsonResponse(body, status=status, content_type=PROBLEM_CONTENT_TYPE)
    response["Cache-Control"] = "no-store"
    return response
