"""The idempotent views of the URLconf, read when asked: for the admin's endpoint filter
and for the system checks that judge each view."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from django.contrib.admindocs.views import simplify_regex
from django.urls import URLPattern, URLResolver, get_resolver, get_script_prefix
from django.urls.resolvers import RoutePattern

from django_idempotency.engine.options import Policy, resolve

# Python's named groups are the one URL-pattern construct PostgreSQL's regexes lack.
_NAMED_GROUP = re.compile(r"\(\?P<\w+>")


@dataclass(frozen=True)
class Endpoint:
    """An idempotent view in the URLconf: its route, a regex over stored paths, the
    methods it protects and the view (a class, or the decorated function) with its
    policy."""

    route: str
    regex: str
    methods: frozenset[str]
    view: Any
    policy: Policy


def _idempotent(callback: Any) -> tuple[frozenset[str], Any, Policy] | None:
    """The methods a URLconf callback makes idempotent, its view and policy; None for
    other views."""
    view_class = getattr(callback, "cls", None)
    if view_class is not None and hasattr(view_class, "get_idempotency_policy"):
        view = view_class(**getattr(callback, "initkwargs", {}))
        actions = getattr(callback, "actions", None)
        served = (
            {m.upper() for m in actions}
            if actions
            else {m.upper() for m in view.http_method_names if hasattr(view, m)}
        )
        policy: Policy = view.get_idempotency_policy()
        return policy.methods & served, view, policy
    # Under other decorators (csrf_exempt, login_required), functools.wraps copied it.
    options = getattr(callback, "idempotency_options", None)
    if options is not None:
        policy = resolve(options)
        return policy.methods, callback, policy
    return None


def _walk(
    patterns: Iterable[URLPattern | URLResolver], route: str, regex: str
) -> Iterator[tuple[str, str, Any]]:
    # (the route as people write it, the full Python regex of path_info, the callback)
    for pattern in patterns:
        piece = pattern.pattern
        here = str(piece) if isinstance(piece, RoutePattern) else simplify_regex(str(piece))[1:]
        joined = regex + piece.regex.pattern.removeprefix("^")
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, route + here, joined)
        else:
            yield route + here, joined, pattern.callback


def idempotent_endpoints() -> list[Endpoint]:
    """The URLconf's idempotent views, read now. Stored paths carry the script prefix,
    path_info does not."""
    root = get_resolver()
    script_prefix = "^" + re.escape(get_script_prefix().rstrip("/"))
    endpoints: dict[str, Endpoint] = {}
    for route, regex, callback in _walk(root.url_patterns, "/", "/"):
        found = _idempotent(callback)
        # The first of two equal routes is the one Django resolves.
        if found and found[0] and route not in endpoints:
            sql_regex = script_prefix + _NAMED_GROUP.sub("(", regex)
            endpoints[route] = Endpoint(route, sql_regex, *found)
    return list(endpoints.values())
