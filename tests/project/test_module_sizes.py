"""One concern per module: a module of the package over 400 lines says in its docstring why
it is still one (issue 30's rule; migrations are frozen and left out)."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "django_idempotency"
LIMIT = 400
REASON = f"Over {LIMIT} lines as one concern"


def long_modules() -> list[str]:
    return sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts and len(path.read_text().splitlines()) > LIMIT
    )


def test_the_rule_sees_the_long_modules() -> None:
    assert long_modules(), "no module over 400 lines: the rule below checks nothing"


@pytest.mark.parametrize("module", long_modules())
def test_a_module_over_400_lines_says_why_it_is_one_concern(module: str) -> None:
    docstring = ast.get_docstring(ast.parse((PACKAGE / module).read_text())) or ""
    assert REASON in docstring, f"{module}: split it, or say in its docstring why it is one concern"
