"""What each idempotent view of the URLconf risks: a claim before authentication (E014), a
view reachable anonymously with no scope for anonymous keys (E017), a durable block (W005),
records away from its writes (E012), a key run again after a version change (W021)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.db import router
from django.utils.translation import gettext as _

from django_idempotency.checks.base import ours
from django_idempotency.engine.errors import Misconfigured
from django_idempotency.engine.work import view_name
from django_idempotency.http.endpoints import idempotent_endpoints, written_model
from django_idempotency.models import IdempotencyRecord


@register(Tags.urls)
def check_views(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """What each idempotent view of the URLconf risks: a shared anonymous scope, a durable
    block that cannot run in the claim's transaction."""
    # Like Django's own URL checks: no URLconf, nothing to judge.
    if not ours(app_configs) or not getattr(settings, "ROOT_URLCONF", None):
        return []
    messages: list[CheckMessage] = []
    # One message per view (a viewset or a class served on several routes), naming the
    # routes it concerns.
    for endpoints in _by_view(_endpoints()):
        handler = endpoints[0].handler
        label = view_name(inspect.unwrap(handler) if callable(handler) else handler)
        early = [e for e in endpoints if _claims_before_authentication(e)]
        shared = [e for e in endpoints if e not in early and _shares_anonymous_principal(e)]
        if early:
            messages.append(
                Error(
                    _(
                        "The idempotent view %(routes)s (%(view)s) is decorated with "
                        "@idempotent outside the view's own dispatch (above @api_view, around "
                        "as_view(), or on dispatch()), so the key is claimed before the view "
                        "authenticates the client: every caller shares the anonymous principal."
                    )
                    % {"routes": _routes(early), "view": label},
                    hint=_(
                        "Put @idempotent below @api_view (next to the function), use "
                        "IdempotencyMixin on a DRF class view, or decorate the method handler "
                        '(method_decorator(idempotent, name="post")).'
                    ),
                    id="django_idempotency.E014",
                )
            )
        if shared:
            messages.append(
                Error(
                    _(
                        "The idempotent view %(routes)s (%(view)s) can be reached by "
                        "anonymous clients, and gives their keys no scope of their own: each "
                        "of their keyed requests is refused (500 misconfigured), since all of "
                        "them would share one principal and replay each other's responses."
                    )
                    % {"routes": _routes(shared), "view": label},
                    hint=_(
                        "Require authentication before the claim (DRF permission classes, "
                        "Ninja auth, login_required or the view's own authentication decorator "
                        "above @idempotent), or give the view a principal callable "
                        "(idempotency_principal / principal=) that tells anonymous clients "
                        "apart, such as by API client; or, where anonymous keys are meant (a "
                        "receiver scoped by its key), set allow_anonymous=True."
                    ),
                    id="django_idempotency.E017",
                )
            )
        if _opens_durable_block(handler):
            messages.append(
                CheckWarning(
                    _(
                        "The idempotent view %(routes)s (%(view)s) opens "
                        "transaction.atomic(durable=True), which cannot run inside the "
                        "transaction that holds its key: such requests fail with a clear "
                        "error instead of running."
                    )
                    % {"routes": _routes(endpoints), "view": label},
                    hint=_("Use a plain transaction.atomic() in an idempotent view."),
                    id="django_idempotency.W005",
                )
            )
        rerun = [e for e in endpoints if e.policy.rerun_other_versions]
        if rerun:
            messages.append(
                CheckWarning(
                    _(
                        "The idempotent view %(routes)s (%(view)s) runs a key's request again "
                        "when its record was stored under another response version "
                        "(rerun_other_versions): after a version change, a retry of a request "
                        "that already took effect takes effect a second time."
                    )
                    % {"routes": _routes(rerun), "view": label},
                    hint=_(
                        "Keep this only where the view's effect is itself idempotent (it sets "
                        "state rather than adding to it); otherwise remove "
                        "rerun_other_versions, and such retries get 410 "
                        "response-version-changed."
                    ),
                    id="django_idempotency.W021",
                )
            )
    return messages


def _by_view(endpoints: list[Any]) -> list[list[Any]]:
    groups: dict[Any, list[Any]] = {}
    for endpoint in endpoints:
        groups.setdefault(endpoint.handler, []).append(endpoint)
    return list(groups.values())


def _shares_anonymous_principal(endpoint: Any) -> bool:
    policy = endpoint.policy
    return policy.principal is None and not policy.allow_anonymous and _open_to_anonymous(endpoint)


def _routes(endpoints: list[Any]) -> str:
    return ", ".join(dict.fromkeys(endpoint.route for endpoint in endpoints))


def _endpoints() -> list[Any]:
    try:
        return idempotent_endpoints()
    except Misconfigured:  # a setting of the wrong type: E013 says which
        return []


def _claims_before_authentication(endpoint: Any) -> bool:
    """``@idempotent`` around the whole dispatch of a class view that authenticates there
    (DRF's, or one with Django's access mixins): on the function that ``@api_view`` or
    ``as_view()`` returned, or on ``dispatch()`` (which ``as_view()`` copies from)."""
    handler = endpoint.handler
    view_class = getattr(handler, "cls", None) or getattr(handler, "view_class", None)
    if view_class is None or getattr(handler, "idempotency_options", None) is None:
        return False
    from django.contrib.auth.mixins import AccessMixin

    return hasattr(view_class, "permission_classes") or issubclass(view_class, AccessMixin)


def _open_to_anonymous(endpoint: Any) -> bool:
    """A DRF view (a class, or ``@api_view``'s) whose permissions all allow anonymous
    clients, a Ninja operation without ``auth``, or a plain function view that nothing
    but Django's own view decorators wraps above ``@idempotent``. Plain class views, and
    functions under decorators of other kinds, cannot be judged from outside: their
    anonymous keys are refused when they come."""
    view = endpoint.view
    if hasattr(view, "auth_callbacks") and hasattr(view, "view_func"):  # Ninja's operation
        return not view.auth_callbacks
    permissions = getattr(view, "permission_classes", None)
    if permissions is not None:
        from rest_framework.permissions import AllowAny

        return all(permission is AllowAny for permission in permissions)
    return _nothing_authenticates(endpoint.callback)


# Where the wrappers of Django's own view decorators are defined (csrf_exempt,
# require_POST, never_cache, ...): none of them authenticates.
_DJANGO_VIEW_DECORATORS = "django/views/decorators/"
_IDEMPOTENT_WRAPPERS = "django_idempotency/decorators.py"
_LOGIN_REQUIRED = "django.contrib.auth.middleware.LoginRequiredMiddleware"


def _nothing_authenticates(callback: Any) -> bool:
    """Whether the URLconf calls this function view's ``@idempotent`` wrapper through
    Django's own view decorators only, and no LoginRequiredMiddleware guards it."""
    guarded = _LOGIN_REQUIRED in settings.MIDDLEWARE and getattr(callback, "login_required", True)
    if callback is None or guarded:
        return False
    func = callback
    while func is not None:
        code = getattr(func, "__code__", None)
        if code is None:
            return False
        where = code.co_filename.replace("\\", "/")
        if where.endswith(_IDEMPOTENT_WRAPPERS):
            return True
        if _DJANGO_VIEW_DECORATORS not in where:
            return False  # a decorator of another kind may authenticate
        func = getattr(func, "__wrapped__", None)
    return False


def _opens_durable_block(handler: Any) -> bool:
    try:
        source = inspect.getsource(inspect.unwrap(handler))
    except (OSError, TypeError):
        return False
    return re.search(r"atomic\([^)]*durable\s*=\s*True", source) is not None


@register(Tags.database)
def check_records_follow_writes(
    app_configs: Sequence[AppConfig] | None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """A generic view's records go to the database of its model's writes: the records'
    table must be migrated there, or every request of that view fails."""
    if not ours(app_configs) or not databases or not getattr(settings, "ROOT_URLCONF", None):
        return []
    messages: list[CheckMessage] = []
    for endpoint in _endpoints():
        model = written_model(endpoint.view) if endpoint.policy.using is None else None
        if model is None:
            continue
        alias = router.db_for_write(model)
        if alias in databases and not router.allow_migrate_model(alias, IdempotencyRecord):
            messages.append(
                Error(
                    _(
                        "The idempotent view %(route)s writes %(model)s to database "
                        "%(alias)r, where its records must live to commit with those writes, "
                        "but the routers do not migrate IdempotencyRecord there."
                    )
                    % {"route": endpoint.route, "model": model._meta.label, "alias": alias},
                    hint=_(
                        "Let allow_migrate() accept django_idempotency on %(alias)r and "
                        "migrate it, or give the view idempotency_using."
                    )
                    % {"alias": alias},
                    id="django_idempotency.E012",
                )
            )
    return messages
