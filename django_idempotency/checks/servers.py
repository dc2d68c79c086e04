"""What the server shape asks: a waiter cap that leaves a request thread free (W008), no
persistent connections under ASGI without a pool (W009)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, register
from django.core.checks import Warning as CheckWarning
from django.db import connections
from django.utils.translation import gettext as _

from django_idempotency.checks.base import as_written, ours
from django_idempotency.engine.waiting import server_threads


@register()
def check_servers(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """What the server shape asks of waiting duplicates and of database connections."""
    if not ours(app_configs):
        return []
    messages: list[CheckMessage] = []
    cap = as_written("MAX_WAITERS")
    threads, source = (None, "") if _invalid_integer("SERVER_THREADS") else server_threads()
    if isinstance(cap, int) and cap > 0 and threads is not None and cap >= threads:
        messages.append(
            CheckWarning(
                _(
                    "IDEMPOTENCY_MAX_WAITERS is %(cap)d, but a server process has %(threads)d "
                    "request thread(s) (%(source)s): waiting duplicates could hold every "
                    "thread, and other requests would wait behind them."
                )
                % {"cap": cap, "threads": threads, "source": source},
                hint=_(
                    "Set IDEMPOTENCY_MAX_WAITERS to %(most)d or fewer (leave a thread for each "
                    "slow request you expect at once), or to 0 so that duplicates get 409 at "
                    "once."
                )
                % {"most": max(threads - 1, 0)},
                id="django_idempotency.W008",
            )
        )
    if getattr(settings, "ASGI_APPLICATION", None):
        for alias in connections:
            database = connections[alias].settings_dict
            age = database.get("CONN_MAX_AGE", 0)
            if age != 0 and not database.get("OPTIONS", {}).get("pool"):
                messages.append(
                    CheckWarning(
                        _(
                            "Database %(alias)r keeps connections open (CONN_MAX_AGE = "
                            "%(age)r) and the project runs under ASGI (ASGI_APPLICATION is "
                            "set): Django opens a connection in each request's thread there, "
                            "so connections pile up until the database refuses new clients."
                        )
                        % {"alias": alias, "age": age},
                        hint=_(
                            "Use Django's connection pool (%(pool)s = {'max_size': ...} with "
                            "CONN_MAX_AGE = 0; install psycopg[pool]), or set CONN_MAX_AGE = 0."
                        )
                        % {"pool": f"DATABASES[{alias!r}]['OPTIONS']['pool']"},
                        id="django_idempotency.W009",
                    )
                )
    return messages


def _invalid_integer(name: str) -> bool:
    value = as_written(name)
    return value is not None and (not isinstance(value, int) or isinstance(value, bool))
