"""Stored responses at rest: encryption keys that cannot seal (E015), and a deployment
that keeps responses in plain text (W010, ``check --deploy``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.utils.translation import gettext as _

from django_idempotency.checks.base import ours
from django_idempotency.conf import conf, wrong_type
from django_idempotency.storage import sealing

GENERATE = 'python -c "import base64, os; print(base64.b64encode(os.urandom(32)).decode())"'


@register()
def check_keys(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """Keys that are listed but cannot seal: requests would be refused."""
    # A setting of the wrong type is E013's.
    if not ours(app_configs) or wrong_type("ENCRYPTION_KEYS") or not conf.ENCRYPTION_KEYS:
        return []
    try:
        sealing.keyring(conf.ENCRYPTION_KEYS)
    except sealing.MalformedKeys as exc:
        return [
            Error(
                _(
                    "%(problem)s Idempotent requests are refused (500 misconfigured) until it "
                    "is fixed; no response is ever stored in plain text instead."
                )
                % {"problem": exc},
                hint=_(
                    "Each key is 32 random bytes in base64, listed once: %(command)s (and "
                    "install django-idempotency[encryption])."
                )
                % {"command": GENERATE},
                id="django_idempotency.E015",
            )
        ]
    return []


@register(Tags.security, deploy=True)
def check_plain_text(app_configs: Sequence[AppConfig] | None, **kwargs: Any) -> list[CheckMessage]:
    """A deployment that keeps stored responses (tokens, IBANs, personal data) in plain text."""
    if not ours(app_configs) or wrong_type("ENCRYPTION_KEYS") or conf.ENCRYPTION_KEYS:
        return []
    return [
        CheckWarning(
            _(
                "Stored responses are kept in plain text: whoever reads the records' table (a "
                "backup, a replica, a read-only database user) reads every response replayed "
                "for a day, tokens and personal data included."
            ),
            hint=_("Set IDEMPOTENCY_ENCRYPTION_KEYS to a list holding one key: %(command)s")
            % {"command": GENERATE},
            id="django_idempotency.W010",
        )
    ]
