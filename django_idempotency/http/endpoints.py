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

from django_idempotency.http.options import Policy, policy_for, resolve

# Python's named groups are the one URL-pattern construct PostgreSQL's regexes lack.
_NAMED_GROUP = re.compile(r"\(\?P<\w+>")
# What simplify_regex() leaves escaped: DRF's format suffixes ("charges\.<format>").
_ESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True)
class Endpoint:
    """An idempotent view in the URLconf: its route, a regex over stored paths, the methods
    it protects, the view that serves it (a DRF view instance, a plain function, a class
    view's instance, a Ninja operation), the code that is idempotent (``handler``: the
    view's class, the decorated function or method, the operation's function) and its
    policy."""

    route: str
    regex: str
    methods: frozenset[str]
    view: Any
    policy: Policy
    handler: Any
    # What the URLconf calls, with the decorators around the view: what runs before it.
    callback: Any = None


# (methods protected, view, policy, handler)
Found = tuple[frozenset[str], Any, Policy, Any]


def _closure(func: Any, name: str) -> Any:
    """The variable ``name`` that ``func`` closes over, or None: how DRF's ``@api_view``
    handler holds its function, and how Ninja's URL view holds its path's operations."""
    code = getattr(func, "__code__", None)
    cells = getattr(func, "__closure__", None) or ()
    if code is None or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except (IndexError, ValueError):  # an empty cell
        return None


def _options(func: Any) -> Any:
    """The ``@idempotent`` options of a function, a ``method_decorator`` method or an
    ``@api_view`` handler (whose function is in its closure); None for others."""
    # Under other decorators (csrf_exempt, login_required), functools.wraps copied them.
    options = getattr(func, "idempotency_options", None)
    if options is None:
        options = getattr(_closure(func, "func"), "idempotency_options", None)
    return options


def _idempotent(callback: Any) -> list[Found]:
    """What a URLconf callback makes idempotent: one entry per policy (a class view may
    protect each method its own way); empty for other views."""
    options = getattr(callback, "idempotency_options", None)
    # @idempotent on a function, or around a class view's whole dispatch (above @api_view,
    # around as_view(), on dispatch() with method_decorator).
    if options is not None:
        policy = resolve(options)
        return [(policy.methods, callback, policy, callback)]
    view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    if view_class is not None:
        return _class_view(callback, view_class)
    path_view = _closure(callback, "self")
    if path_view is not None and hasattr(path_view, "operations"):  # Ninja's
        return _operations(path_view.operations)
    return []


def _class_view(callback: Any, view_class: type) -> list[Found]:
    initkwargs = getattr(callback, "initkwargs", None) or getattr(callback, "view_initkwargs", {})
    view = view_class(**initkwargs)
    actions = getattr(callback, "actions", None)
    served = (
        {m.upper(): getattr(view, a, None) for m, a in actions.items()}
        if actions
        else {m.upper(): getattr(view, m, None) for m in view.http_method_names}
    )
    if hasattr(view, "get_idempotency_policy"):  # IdempotencyMixin
        policy: Policy = view.get_idempotency_policy()
        handled = {m for m, handler in served.items() if handler is not None}
        return [(policy.methods & handled, view, policy, view_class)]
    # method_decorator(idempotent, name=...) on a class view's handlers, or @idempotent
    # under @api_view (its class's handlers call the function): one entry per function. (On
    # dispatch(), as_view() copied the options onto the callback itself.)
    functions: dict[int, Any] = {}
    served_by: dict[int, set[str]] = {}
    for method, handler in served.items():
        options = _options(handler)
        if options is None or method not in resolve(options).methods:
            continue
        function = getattr(_closure(handler, "func"), "__wrapped__", None) or handler
        functions.setdefault(id(function), (function, options))
        served_by.setdefault(id(function), set()).add(method)
    return [
        (frozenset(served_by[ident]), view, resolve(options), function)
        for ident, (function, options) in functions.items()
    ]


def _operations(operations: Iterable[Any]) -> list[Found]:
    found = []
    for operation in operations:
        options = getattr(operation, "idempotency_options", None)
        if options is None:
            continue
        policy = policy_for(operation.view_func, options)
        methods = policy.methods & set(operation.methods)
        if methods:
            found.append((frozenset(methods), operation, policy, operation.view_func))
    return found


def _walk(
    patterns: Iterable[URLPattern | URLResolver], route: str, regex: str
) -> Iterator[tuple[str, str, Any]]:
    # (the route as people write it, the full Python regex of path_info, the callback)
    for pattern in patterns:
        piece = pattern.pattern
        if isinstance(piece, RoutePattern):
            here = str(piece)
        else:  # a regex, as people would write its route: /charges.<format>/
            here = _ESCAPE.sub(r"\1", simplify_regex(str(piece)))[1:]
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
    endpoints: list[Endpoint] = []
    routes: set[str] = set()
    for route, regex, callback in _walk(root.url_patterns, "/", "/"):
        # The first of two equal routes is the one Django resolves.
        if route in routes:
            continue
        found = [entry for entry in _idempotent(callback) if entry[0]]
        if found:
            routes.add(route)
            sql_regex = script_prefix + _NAMED_GROUP.sub("(", regex)
            endpoints += [Endpoint(route, sql_regex, *entry, callback=callback) for entry in found]
    return endpoints


def written_model(view: Any) -> Any:
    """The model a generic view writes (its queryset's), or None."""
    queryset = getattr(view, "queryset", None)
    if queryset is not None:
        return queryset.model
    serializer_class = getattr(view, "serializer_class", None)
    return getattr(getattr(serializer_class, "Meta", None), "model", None)
