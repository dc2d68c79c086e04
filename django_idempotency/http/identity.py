"""What identifies a request: its Idempotency-Key, whose key it is (the principal), and
its fingerprint (method, path, query, canonical body, chosen headers).

Over 400 lines as one concern: most of it is the canonical body (JSON numbers, forms,
charsets), whose rules must be read together to know when two bodies are the same."""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Sized
from functools import lru_cache
from io import BytesIO
from operator import itemgetter
from typing import Any
from uuid import UUID

from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.db import DEFAULT_DB_ALIAS
from django.db.models import Model
from django.http import HttpRequest
from django.http.multipartparser import MultiPartParser, MultiPartParserError

from django_idempotency.conf import PrincipalFunc
from django_idempotency.engine.errors import InvalidKey, PrincipalMissing
from django_idempotency.engine.fingerprints import keyed_parts, principal_digest

MAX_KEY_LENGTH = 255
MAX_PRINCIPAL_LENGTH = 255
# Printable ASCII without the characters that delimit structured-field lists and
# parameters, so a comma list (or two header lines joined by the server) is never a key.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - set('",;\\')
_OWS = " \t"
# RFC 8941 parameters after the quoted key: ";" *SP key ["=" bare-item]. Whitespace before a
# ";" is tolerated, as it always was. A comma outside a string value can only mean a list,
# and this grammar never matches one.
_BARE_ITEM = (
    r"-?[0-9]{1,12}\.[0-9]{1,3}|-?[0-9]{1,15}"  # decimal, integer
    r'|"(?:[ !#-\[\]-~]|\\["\\])*"'  # string
    r"|[A-Za-z*][-!#$%&'*+.^_`|~0-9A-Za-z:/]*"  # token
    r"|:[A-Za-z0-9+/=]*:"  # byte sequence
    r"|\?[01]"  # boolean
)
_PARAMETERS = re.compile(rf"(?:[ \t]*;[ ]*[a-z*][a-z0-9_.*-]*(?:=(?:{_BARE_ITEM}))?)*")
# The header's value, as OpenAPI's pattern documents it: a bare key, or a quoted one with
# parameters. tests/http/test_key_pattern.py holds it to parse_key().
_KEY_CLASS = r"[!#-+\--:<-\[\]-~]"  # _KEY_CHARS
KEY_PATTERN = (
    rf"^(?:{_KEY_CLASS}{{1,{MAX_KEY_LENGTH}}}"
    rf'|"{_KEY_CLASS}{{1,{MAX_KEY_LENGTH}}}"{_PARAMETERS.pattern})$'
)

ANONYMOUS = "anonymous"
# What a principal's name says before its first ":". A string that could be read as one of
# these, or as a model label (which has a dot), is written "str:<string>" so that no two
# principals share a name; other strings are kept as they are, readable in the admin.
# "erased": the principal of a tombstone (storage/erasure.py), never a live one.
_PRINCIPAL_KINDS = frozenset({ANONYMOUS, "user", "str", "int", "uuid", "sha256", "erased"})


def parse_key(raw: str) -> str:
    """Return the key from a header value: an RFC 8941 string or a bare value."""
    value = raw.strip(_OWS)
    if value.startswith('"'):
        end = value.find('"', 1)
        if end == -1:
            raise InvalidKey("The quoted Idempotency-Key has no closing quote.")
        key = value[1:end]
        if key.endswith("\\"):
            raise InvalidKey("The quoted Idempotency-Key may not contain escapes.")
        if end + 1 < len(value) and _PARAMETERS.fullmatch(value, end + 1) is None:
            if "," in value:
                raise InvalidKey("The Idempotency-Key must be a single value.")
            raise InvalidKey("The parameters after the quoted Idempotency-Key are malformed.")
    else:
        key = value
    return check_key(key)


def check_key(key: Any, name: str = "Idempotency-Key") -> str:
    """Return ``key`` if it is a valid key (1 to 255 characters of the key alphabet), else
    raise InvalidKey; ``name`` says where it came from."""
    if not isinstance(key, str):
        raise InvalidKey(f"The {name} must be a string, not {type(key).__name__}.")
    if not key:
        raise InvalidKey(f"The {name} is empty.")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"The {name} is longer than {MAX_KEY_LENGTH} characters.")
    if not _KEY_CHARS.issuperset(key):
        raise InvalidKey(
            f"The {name} may contain only printable ASCII characters other than "
            'space, ", comma, ; and \\.'
        )
    return key


def principal_for(request: Any, func: PrincipalFunc | None, using: str = DEFAULT_DB_ALIAS) -> str:
    """Whose keys these are: the callable's answer, else the authenticated user.

    A principal too long to store, or that PostgreSQL cannot hold, is stored as a keyed
    digest for the records' database ``using``. Raises PrincipalMissing when the callable
    returns nothing usable (None, an empty value, an unsaved instance, a type that cannot
    name a principal).
    """
    if func is not None:
        value = _principal_name(func(request))
    else:
        user = getattr(request, "user", None)
        value = f"user:{user.pk}" if user is not None and user.is_authenticated else ANONYMOUS
    try:
        encoded = value.encode()
        storable = "\x00" not in value  # PostgreSQL text cannot hold NUL
    except UnicodeEncodeError:  # a lone surrogate
        encoded, storable = value.encode("utf-8", "surrogatepass"), False
    if len(value) > MAX_PRINCIPAL_LENGTH or not storable:
        # Keyed: the table does not say who the principal is.
        value = "sha256:" + principal_digest(using, encoded)
    return value


def credentials_of(request: HttpRequest) -> str | None:
    """The credentials that Django's ``request`` carries, named for the log: an
    ``Authorization`` header of any scheme, or the session cookie of a logged-in session
    (one whose session holds a user); None when it carries neither.

    Asked only for the log of a refused anonymous key: with these credentials, the key was
    most likely claimed before the view's own authentication had said who the client is.
    Credentials of other kinds (an API key header) cannot be recognised; the refusal does
    not depend on them.
    """
    if request.headers.get("authorization", "").strip(_OWS):
        return "an Authorization header"
    if settings.SESSION_COOKIE_NAME not in request.COOKIES:
        return None
    # Without SessionMiddleware nothing authenticates by the session cookie. The session is
    # loaded once per request and shared with whatever reads it after us.
    session = getattr(request, "session", None)
    if session is not None and session.get(SESSION_KEY) is not None:
        return "the session cookie of a logged-in session"
    return None


def _principal_name(value: Any) -> str:
    if isinstance(value, Model):
        if value.pk is None:
            raise _no_principal(f"an unsaved {type(value).__name__}")
        return f"{value._meta.label_lower}:{value.pk}"
    if isinstance(value, str):
        if not value:
            raise _no_principal("an empty string")
        text = str(value)
        kind = text.partition(":")[0]
        return f"str:{text}" if kind in _PRINCIPAL_KINDS or "." in kind else text
    # bool is an int, but True/False would put all requests into two scopes.
    if isinstance(value, int) and not isinstance(value, bool):
        return f"int:{int(value)}"
    if isinstance(value, UUID):
        return f"uuid:{value}"
    if value is None:
        raise _no_principal("None")
    empty = isinstance(value, Sized) and not len(value)
    raise _no_principal(f"an empty {type(value).__name__}" if empty else type(value).__name__)


def _no_principal(what: str) -> PrincipalMissing:
    return PrincipalMissing(
        f"The view's principal callable returned {what}; it must return a non-empty string, "
        "an int, a UUID or a saved model instance, so the request was not processed."
    )


_FORM_TYPES = frozenset({"multipart/form-data", "application/x-www-form-urlencoded"})
_COMPACT = json.JSONEncoder(separators=(",", ":"), check_circular=False)
_first = itemgetter(0)


def _canonical_query(query: str) -> bytes:
    # Parameters sorted by name; a name's values keep their order (a view's getlist() sees it),
    # and each stays as it was sent, so two queries a view could tell apart never merge.
    pairs = sorted((part.partition("=")[::2] for part in query.split("&") if part), key=_first)
    return _COMPACT.encode(pairs).encode()


# A header that is absent, told apart from one sent empty: no UTF-8 encoding is this byte.
_ABSENT = b"\xff"


# JSON numbers compare by exact decimal value. A number with an integral value of at most 18
# digits is an int (which json.dumps writes exactly); any other becomes
# {"\x00": "<digits>E<exponent>"}, normalised from its text: a huge exponent, or a long
# integer, is never turned into a big int (1e4299 would be a 4,300-digit int, 1 ms to print).
# An object with a "\x00" key of its own becomes {"\x00": [[key, value], ...]}, so it never
# passes for a number.
_NUMBER = "\x00"
_MAX_INT_DIGITS = 18


def _number(negative: bool, digits: str, exponent: int) -> Any:
    significant = digits.lstrip("0")
    if not significant:
        return 0  # 0, -0, 0.0e5: one value
    stripped = significant.rstrip("0")
    exponent += len(significant) - len(stripped)
    if exponent >= 0 and len(stripped) + exponent <= _MAX_INT_DIGITS:
        value = int(stripped) * 10**exponent
        return -value if negative else value
    return {_NUMBER: f"{'-' if negative else ''}{stripped}E{exponent}"}


def _json_int(text: str) -> Any:
    if len(text) <= _MAX_INT_DIGITS:
        return int(text)
    digits = text.lstrip("-")
    # An integer that json.loads, and so DRF, refuses to parse is not parsed here either.
    limit = sys.get_int_max_str_digits()
    if limit and len(digits) > limit:
        raise ValueError("Exceeds the limit for integer string conversion")
    return _number(text[0] == "-", digits, 0)


def _json_float(text: str) -> Any:
    mantissa, _, exponent = text.lower().partition("e")
    whole, _, fraction = mantissa.lstrip("-").partition(".")
    magnitude = exponent.lstrip("+-").lstrip("0")
    if len(magnitude) > _MAX_INT_DIGITS:
        # An exponent of 10**18 or more: not worth parsing, so the raw bytes count.
        raise ValueError("exponent too long")
    power = (int(magnitude) if magnitude else 0) * (-1 if exponent[:1] == "-" else 1)
    power -= len(fraction)
    return _number(mantissa[0] == "-", whole + fraction, power)


def _json_constant(text: str) -> Any:
    return {_NUMBER: text}  # NaN, Infinity, -Infinity: never a digit string


def _json_object(obj: dict[str, Any]) -> dict[str, Any]:
    if _NUMBER in obj:
        return {_NUMBER: sorted(obj.items(), key=_first)}
    return obj


# Built once: json.loads and json.dumps with options build a new decoder or encoder per call.
# A duplicated key means its last value, as for json.loads and so for DRF.
_DECODER = json.JSONDecoder(
    object_hook=_json_object,
    parse_int=_json_int,
    parse_float=_json_float,
    parse_constant=_json_constant,
)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)


def _drop(data: Any, path: list[str]) -> None:
    head, *rest = path
    if not isinstance(data, dict) or head not in data:
        return
    if rest:
        _drop(data[head], rest)
    else:
        del data[head]


def _canonical_json(raw: bytes, exclude: Iterable[str]) -> bytes | None:
    try:
        # Decoded as DRF decodes it: UTF-8, and a BOM is refused there too.
        data = _DECODER.decode(raw.decode())
    except (ValueError, RecursionError):
        return None
    for field in exclude:
        _drop(data, field.split("."))
    try:
        return _ENCODER.encode(data).encode()
    except (ValueError, RecursionError):
        return None


@lru_cache(maxsize=32)
def _codec_name(charset: str) -> str:
    # Names Django accepted (it sets request.encoding only for a charset codecs knows) or
    # DEFAULT_CHARSET: a few per project, so the cache stays small.
    return codecs.lookup(charset).name


def _charset(request: HttpRequest) -> str:
    # Forms and DRF decode with request.encoding, else DEFAULT_CHARSET. Normalised, so "UTF8"
    # and "utf-8" are one charset.
    return _codec_name(request.encoding or settings.DEFAULT_CHARSET)


def _canonical_form(request: HttpRequest, exclude: tuple[str, ...]) -> bytes:
    # Fields and files are tagged apart ("f", "u"); sorted by name, a name's values keep
    # their order. Parsed by Django, which caps the number of fields
    # (DATA_UPLOAD_MAX_NUMBER_FIELDS); the raw stream of a multipart body may be consumed.
    entries: list[tuple[Any, ...]] = [
        ("f", name, value) for name, values in request.POST.lists() for value in values
    ]
    for name, uploads in request.FILES.lists():
        for upload in uploads:
            digest = hashlib.sha256()
            for chunk in upload.chunks():
                digest.update(chunk)
            upload.seek(0)
            entries.append(
                ("u", name, upload.name, upload.content_type, upload.charset, digest.hexdigest())
            )
    if exclude:
        entries = [entry for entry in entries if entry[1] not in exclude]
    entries.sort(key=_name_then_kind)
    return _COMPACT.encode(entries).encode()


def _name_then_kind(entry: tuple[Any, ...]) -> tuple[str, str]:
    return entry[1], entry[0]


def has_body(meta: dict[str, Any]) -> bool:
    """Whether a request announces a body (a length other than 0, or chunks)."""
    return meta.get("CONTENT_LENGTH", "0") not in ("", "0") or "HTTP_TRANSFER_ENCODING" in meta


def unparseable_multipart(request: HttpRequest) -> str | None:
    """Why Django cannot parse this request's multipart body (no boundary, a malformed
    one, a negative length), found from its headers without reading it; None when it is no
    multipart body, or one Django parses."""
    if request.content_type != "multipart/form-data" or not has_body(request.META):
        return None
    try:
        # The parser checks its headers when it is built, and reads only when it parses.
        MultiPartParser(request.META, BytesIO(), [], request.encoding)
    except MultiPartParserError as exc:
        return str(exc)
    return None


def canonical_body(request: HttpRequest, exclude: Iterable[str] = ()) -> bytes:
    """The body in a canonical form, headed by its kind, media type and charset: JSON
    re-serialised with sorted keys and exact numbers, form fields sorted by name, multipart
    fields and file digests; anything else (JSON in another charset too) as raw bytes."""
    exclude = tuple(exclude)
    content_type = request.content_type or ""
    charset = _charset(request)
    # Length-prefixed, so the head never runs into the body.
    head = f"{len(content_type)}:{content_type};{charset};".encode("utf-8", "surrogatepass")
    if content_type in _FORM_TYPES:
        return b"form:" + head + _canonical_form(request, exclude)
    raw = request.body
    if (content_type == "application/json" or content_type.endswith("+json")) and (
        charset == "utf-8"
    ):
        canonical = _canonical_json(raw, exclude)
        if canonical is not None:
            return b"json:" + head + canonical
    return b"raw:" + head + raw


@lru_cache(maxsize=64)
def _meta_name(header: str) -> str:
    # Names come from the view's configuration, not from clients: the cache stays small.
    name = header.upper().replace("-", "_")
    return name if name in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{name}"


def fingerprint_messages(
    request: HttpRequest,
    exclude: Iterable[str] = (),
    headers: Iterable[str] = (),
    *,
    media_type: str | None = None,
) -> dict[str, bytes]:
    """What each part of the fingerprint digests: the canonical method, path, query, body
    and the named headers (``media_type``, the negotiated one of a view with several
    renderers, is the part ``header:accept``)."""
    meta = request.META
    parts = {
        "method": (request.method or "").encode(),
        "path": request.path.encode("utf-8", "surrogatepass"),
        "query": _canonical_query(meta.get("QUERY_STRING", "")),
        "body": canonical_body(request, exclude),
    }
    for name in headers:
        value = meta.get(_meta_name(name))
        parts[f"header:{name.lower()}"] = (
            _ABSENT if value is None else value.encode("utf-8", "surrogatepass")
        )
    if media_type is not None:
        parts["header:accept"] = media_type.encode("utf-8", "surrogatepass")
    return parts


def fingerprint(
    request: HttpRequest,
    exclude: Iterable[str] = (),
    headers: Iterable[str] = (),
    *,
    media_type: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> dict[str, str]:
    """Keyed digest of each part of the request, so a mismatch can name the parts that
    differ; keyed for the records' database ``using``."""
    messages = fingerprint_messages(request, exclude, headers, media_type=media_type)
    return keyed_parts(using, messages)
