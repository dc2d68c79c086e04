"""A view of the suite's own, not of the payments API: the charge handler of
``/api/charges-django/`` written as the docs' plain view, with the decorators in the wrong
order. ``@idempotent`` sits above the view's own authentication, so the key is claimed, and
a stored answer replayed, before the token is read: every caller is the anonymous
principal. A careless user writes it; the library must not let it run a key for one
principal and replay it to another (the ``@idempotent above authentication`` shape)."""

from __future__ import annotations

import inspect

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_idempotency.decorators import idempotent
from testproject.payments.views import charge_without_drf, token_required

# The handler itself, under the testproject's decorators (each keeps __wrapped__).
handler = inspect.unwrap(charge_without_drf)


@csrf_exempt
@require_POST
@idempotent(required=True)
@token_required
def charge_misordered(request: HttpRequest) -> HttpResponse:
    response: HttpResponse = handler(request)
    return response
