"""A view's options, declared once in ``ViewOptions`` (the decorator's keyword arguments, the
mixin's ``idempotency_<name>`` attributes), and the ``Policy`` they resolve to over the settings."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypedDict

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.http import HttpRequest

from django_idempotency.conf import REQUEST_SETTINGS, PrincipalFunc, conf, wrong_type
from django_idempotency.engine.errors import Misconfigured

logger = logging.getLogger("django_idempotency")

# Reads a webhook receiver's key from the verified request (Django's HttpRequest), for
# example the event id inside a signed JSON body; None when the request carries none.
KeyFunc = Callable[[HttpRequest], str | None]


class ViewOptions(TypedDict, total=False):
    """Per-view overrides; an option left out (or ``None``) takes its setting."""

    methods: Sequence[str] | None
    required: bool | None
    ttl: timedelta | None
    wait: timedelta | None
    exclude_fields: Sequence[str] | None
    fingerprint_headers: Sequence[str] | None
    principal: PrincipalFunc | None
    lookup_first: bool | None
    # The header that carries the key, for a webhook receiver: "X-GitHub-Delivery".
    key_header: str | None
    # Or a callable that reads the key from the verified request, for a key the sender's
    # signature covers but no header carries: Stripe's event id in the signed body.
    key_from: KeyFunc | None
    # The database of the view's writes (an alias, or a callable of the request), where its
    # records must live for the one-transaction guarantee; by default the router's.
    using: str | Callable[[HttpRequest], str] | None
    # Keys of anonymous clients are meant (a receiver scoped otherwise): no refusal of a
    # keyed request under the anonymous principal, and no error E017.
    allow_anonymous: bool | None
    # The version of the view's responses ("2026-11"): a record stored under another version
    # is never replayed, and the same request on it gets 410 response-version-changed.
    # Changing it is a deploy step (docs/data-you-keep.md).
    response_version: str | None
    # Run such a request anew instead, for a view whose effect is itself idempotent (a PUT
    # of a whole resource): warning W021 names each view that does.
    rerun_other_versions: bool | None


OPTION_NAMES: tuple[str, ...] = tuple(ViewOptions.__annotations__)


@dataclass(frozen=True, slots=True)
class Policy:
    """A view's options resolved over the settings: what the engine reads per request."""

    methods: frozenset[str]
    required: bool
    ttl: timedelta
    wait: timedelta
    exclude_fields: tuple[str, ...]
    fingerprint_headers: tuple[str, ...]
    principal: PrincipalFunc | None
    lookup_first: bool
    using: str | Callable[[HttpRequest], str] | None
    allow_anonymous: bool
    key_from: KeyFunc | None
    version: str | None
    rerun_other_versions: bool
    # The key's header, and as it appears in request.META.
    header: str
    header_meta: str


def resolve(options: ViewOptions) -> Policy:
    """The policy of these options over the settings; raises Misconfigured when a setting
    that requests read has the wrong type (or IDEMPOTENCY_PRINCIPAL cannot be imported)."""
    _require_valid_settings()
    methods = options.get("methods")
    ttl = options.get("ttl")
    wait = options.get("wait")
    exclude = options.get("exclude_fields")
    headers = options.get("fingerprint_headers")
    required = options.get("required")
    lookup_first = options.get("lookup_first")
    principal = options.get("principal")
    header = options.get("key_header") or conf.HEADER
    key_from = options.get("key_from")
    if key_from is not None and options.get("key_header"):
        raise ImproperlyConfigured(
            "An idempotent view sets both key_header and key_from; the key comes from one "
            "place. Keep key_from (a key the sender's signature covers) and drop key_header."
        )
    return Policy(
        methods=conf.METHODS if methods is None else frozenset(m.upper() for m in methods),
        required=conf.REQUIRED if required is None else required,
        # The maximum decides when partitions are dropped, so no view may outlive it.
        ttl=min(conf.TTL if ttl is None else ttl, conf.MAX_TTL),
        wait=conf.WAIT if wait is None else wait,
        exclude_fields=tuple(exclude or ()),
        fingerprint_headers=conf.FINGERPRINT_HEADERS if headers is None else tuple(headers),
        # A plain function stored on a view class comes back bound to the view.
        principal=getattr(principal, "__func__", principal) or conf.PRINCIPAL,
        lookup_first=conf.LOOKUP_FIRST if lookup_first is None else lookup_first,
        using=getattr(options.get("using"), "__func__", options.get("using")),
        allow_anonymous=bool(options.get("allow_anonymous")),
        key_from=getattr(key_from, "__func__", key_from),
        version=options.get("response_version") or conf.RESPONSE_VERSION,
        rerun_other_versions=bool(options.get("rerun_other_versions")),
        header=header,
        header_meta="HTTP_" + header.upper().replace("-", "_"),
    )


def _require_valid_settings() -> None:
    # Once per view (policies are cached): a wrong type found here would otherwise fail
    # deep inside a request, or worse, be read as something else (bool("False") is True).
    problems = [problem for name in REQUEST_SETTINGS if (problem := wrong_type(name))]
    if not problems:
        try:
            principal: Any = conf.PRINCIPAL  # imports a dotted path
        except ImportError as exc:
            problems.append(f"IDEMPOTENCY_PRINCIPAL cannot be imported ({exc}).")
        else:
            if principal is not None and not callable(principal):
                problems.append("IDEMPOTENCY_PRINCIPAL is not callable.")
    if problems:
        logger.error(
            "Idempotent requests are refused until the settings are fixed (`manage.py "
            "check` lists them): %s",
            " ".join(problems),
        )
        raise Misconfigured(
            "The server's idempotency settings are invalid, so the request was not processed."
        )


# Resolved once per view and set of option values (one class serves several URLs with
# other as_view() arguments), dropped whenever a setting changes.
_policies: dict[tuple[Any, ...], tuple[tuple[Any, ...], Policy]] = {}


def policy_for(owner: Any, options: ViewOptions) -> Policy:
    """The policy of ``owner`` (a view class or function) with these options, cached."""
    values = tuple(options.values())
    key = (owner, *map(id, values))
    cached = _policies.get(key)
    # Identity, not equality: cheap, and an id reused by a new object is never mistaken.
    if cached is not None and all(a is b for a, b in zip(cached[0], values, strict=True)):
        return cached[1]
    policy = resolve(options)
    _policies[key] = (values, policy)
    return policy


def _forget(*, setting: str, **kwargs: Any) -> None:
    if setting.startswith("IDEMPOTENCY_") or setting == "SECRET_KEY":
        _policies.clear()


def connect_signals() -> None:
    """Called from ``AppConfig.ready()``: ``override_settings`` refreshes the policies."""
    setting_changed.connect(_forget, dispatch_uid="django_idempotency.options")
