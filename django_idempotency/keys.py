"""The Idempotency-Key header value, and whose key it is."""

from __future__ import annotations

import hashlib
from typing import Any

from django_idempotency.conf import PrincipalFunc
from django_idempotency.exceptions import InvalidKey

MAX_KEY_LENGTH = 255
# Printable ASCII without the characters that delimit structured-field lists and
# parameters, so a comma list (or two header lines joined by the server) is never a key.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - set('",;\\')
_OWS = " \t"
ANONYMOUS = "anonymous"


def parse_key(raw: str) -> str:
    """Return the key from a header value: an RFC 8941 string or a bare value."""
    value = raw.strip(_OWS)
    if value.startswith('"'):
        end = value.find('"', 1)
        if end == -1:
            raise InvalidKey("The quoted Idempotency-Key has no closing quote.")
        key, rest = value[1:end], value[end + 1 :].lstrip(_OWS)
        # Parameters are allowed (and ignored); anything else means a list or garbage.
        if rest and (not rest.startswith(";") or "," in rest):
            raise InvalidKey("The Idempotency-Key must be a single value.")
    else:
        key = value
    if not key:
        raise InvalidKey("The Idempotency-Key is empty.")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"The Idempotency-Key is longer than {MAX_KEY_LENGTH} characters.")
    if not _KEY_CHARS.issuperset(key):
        raise InvalidKey(
            "The Idempotency-Key may contain only printable ASCII characters other than "
            'space, ", comma, ; and \\.'
        )
    return key


def principal_for(request: Any, func: PrincipalFunc | None) -> str:
    """Whose keys these are: the callable's answer, else the authenticated user."""
    if func is not None:
        value = str(func(request))
    else:
        user = getattr(request, "user", None)
        value = f"user:{user.pk}" if user is not None and user.is_authenticated else ANONYMOUS
    if len(value) > 255:
        value = "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    return value
