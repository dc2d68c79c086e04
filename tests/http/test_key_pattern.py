"""The key header's OpenAPI pattern (``KEY_PATTERN``) accepts exactly what ``parse_key()``
accepts, so a client generated from the schema sends no key the server refuses, and a fuzzer
that keeps to the schema gets no 400 invalid-key."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from django_idempotency.engine.errors import InvalidKey
from django_idempotency.http.identity import _KEY_CHARS, KEY_PATTERN, MAX_KEY_LENGTH, parse_key

PATTERN = re.compile(KEY_PATTERN)
# ASCII and a little beyond: the characters a header value can carry, and those it cannot.
CHARACTERS = st.characters(min_codepoint=0, max_codepoint=0x17F)
KEYS = st.text(alphabet=sorted(_KEY_CHARS), min_size=1, max_size=MAX_KEY_LENGTH + 2)
PARAMETERS = st.lists(
    st.tuples(
        st.sampled_from(["", " ", "\t"]),
        st.from_regex(r"[a-z*][a-z0-9_.*-]{0,5}", fullmatch=True),
        st.sampled_from(["", "=1", "=-2.5", '="x y"', "=tok/en", "=:aGk=:", "=?1", "=", "=,"]),
    ),
    max_size=3,
)


def accepted(value: str) -> bool:
    try:
        parse_key(value)
    except InvalidKey:
        return False
    return True


def agree(value: str) -> None:
    # Header values reach the server trimmed of surrounding whitespace (RFC 9110 5.5).
    if value != value.strip(" \t"):
        return
    assert bool(PATTERN.fullmatch(value)) == accepted(value), value


@settings(max_examples=500)
@given(st.text(alphabet=CHARACTERS, max_size=300))
@example("a b")  # a space is refused; the docs once forgot to say so
@example("k" * MAX_KEY_LENGTH)
@example("k" * (MAX_KEY_LENGTH + 1))
@example('"k";a=1, "j"')
def test_any_text(value: str) -> None:
    agree(value)


@settings(max_examples=500)
@given(KEYS)
def test_bare_keys(key: str) -> None:
    agree(key)


@settings(max_examples=500)
@given(KEYS, PARAMETERS, st.sampled_from(["", ",", ", x", "x"]))
def test_quoted_keys_with_parameters(
    key: str, parameters: list[tuple[str, str, str]], tail: str
) -> None:
    value = f'"{key}"' + "".join(f"{space};{name}{item}" for space, name, item in parameters)
    agree(value + tail)


@pytest.mark.parametrize("value", ["8e03978e-40d5-43e8-bc93-6894a57f9324", '"order-42";v=1'])
def test_the_documented_shapes_match(value: str) -> None:
    assert PATTERN.fullmatch(value)
