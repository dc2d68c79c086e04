"""What importing each module of django_idempotency needs, read from its source (AST), and
the import walk that proves it.

Two users: tests/project/test_imports.py (every import is of a declared distribution; no
third-party class subscripted at run time) and .ci/release-check, which runs this file with the
Python of a fresh virtualenv holding the wheel and some extras:

    python tests/support/imports.py walk EXTRA...

That imports, for real, every module of the installed package that those extras make
importable (with Django set up by DJANGO_SETTINGS_MODULE), and fails on the first that does
not import. Standard library only: nothing else is installed there.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "django_idempotency"

# The top-level module each optional distribution is imported as (a cell of the release check
# has only some of them installed, so this cannot be read from the environment there;
# tests/project/test_imports.py checks it against importlib.metadata where all are installed).
IMPORT_NAMES = {
    "adrf": "adrf",
    "celery": "celery",
    "cryptography": "cryptography",
    "django-celery-beat": "django_celery_beat",
    "django-ninja": "ninja",
    "django-tasks": "django_tasks",
    "djangorestframework": "rest_framework",
    "drf-spectacular": "drf_spectacular",
    "kombu": "kombu",
    "nats-py": "nats",
    "opentelemetry-api": "opentelemetry",
    "psycopg": "psycopg",
    "standardwebhooks": "standardwebhooks",
    "zstandard": "zstandard",
}
# Django's own modules that only some Django versions have: the Tasks framework is built in
# from 6.0; on 5.2 the tasks extra's backport stands in (messaging/tasks_framework.py).
DJANGO_FROM = {"django.tasks": (6, 0)}
ALWAYS = {"django", "asgiref", "sqlparse"}  # Django and what Django itself requires


@dataclass
class Imports:
    """The imports of one module. Run when it is imported: ``needed`` (all of them),
    ``alternatives`` (a ``try``/``except ImportError`` whose either side may do) and
    ``conditional`` (under an ``if``, or a ``try``'s ``else``: a flag set by such a ``try``
    decides); run later, in a function: ``later``."""

    needed: set[str] = field(default_factory=set)
    alternatives: list[tuple[set[str], set[str]]] = field(default_factory=list)
    conditional: set[str] = field(default_factory=set)
    later: set[str] = field(default_factory=set)

    def everything(self) -> set[str]:
        either = {name for pair in self.alternatives for side in pair for name in side}
        return self.needed | self.conditional | self.later | either


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(kind, ast.Name) and kind.id in ("ImportError", "ModuleNotFoundError")
        for kind in kinds
    )


def imported(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The absolute module names an import statement loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's package
        base = ".".join(
            [*module.split(".")[: -node.level], *([node.module] if node.module else [])]
        )
        return [base, *(f"{base}.{alias.name}" for alias in node.names)]
    assert node.module is not None
    # "from package import name": name may be a submodule, loaded too
    return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]


def runtime_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a body, without what ``if TYPE_CHECKING:`` guards (its ``else`` runs)."""
    for statement in body:
        if isinstance(statement, ast.If) and is_type_checking(statement.test):
            yield from runtime_statements(statement.orelse)
        else:
            yield statement


def collect(body: list[ast.stmt], module: str, found: Imports, into: set[str]) -> Imports:
    """Walks a body run at import (a module's, a class's): its imports go into ``into``, those
    of a function into ``found.later``, of an ``if`` into ``found.conditional``."""
    for statement in runtime_statements(body):
        if isinstance(statement, ast.Import | ast.ImportFrom):
            into.update(imported(statement, module))
        elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            collect(statement.body, module, found, found.later)
        elif into is found.later and isinstance(statement, ast.If | ast.Try):
            for name in ("body", "orelse", "finalbody"):  # in a function: all later
                collect(getattr(statement, name, []), module, found, into)
            for handler in getattr(statement, "handlers", []):
                collect(handler.body, module, found, into)
        elif isinstance(statement, ast.Try) and any(
            catches_import_error(h) for h in statement.handlers
        ):
            tried: set[str] = set()
            fallback: set[str] = set()
            collect(statement.body, module, found, tried)
            for handler in statement.handlers:
                collect(handler.body, module, found, fallback)
            found.alternatives.append((tried, fallback))
            collect(statement.orelse, module, found, found.conditional)
            collect(statement.finalbody, module, found, into)
        elif isinstance(statement, ast.If):
            collect(statement.body + statement.orelse, module, found, found.conditional)
        elif isinstance(statement, ast.ClassDef | ast.With | ast.For | ast.While | ast.Try):
            for name in ("body", "orelse", "finalbody"):
                collect(getattr(statement, name, []), module, found, into)
            for handler in getattr(statement, "handlers", []):
                collect(handler.body, module, found, into)
    return found


def package_root() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # finds it without importing it
    assert spec is not None and spec.origin is not None, f"{PACKAGE} is not installed"
    return Path(spec.origin).parent


def modules(root: Path | None = None) -> dict[str, Path]:
    """Every module of the package (migrations included), by dotted name."""
    root = root or package_root()
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports_of(name: str, path: Path) -> Imports:
    # In a package's __init__, "from . import x" is relative to the package itself.
    anchor = f"{name}.__init__" if path.name == "__init__.py" else name
    found = Imports()
    return collect(parse(path).body, anchor, found, found.needed)


def third_party(name: str) -> str | None:
    """The top-level module a dotted name belongs to, unless it is the standard library's or
    the package's own."""
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == PACKAGE or top == "__future__":
        return None
    return top


class Walk:
    """Which modules of the installed package can be imported with the given extras."""

    def __init__(
        self, extras: set[str], requirements: dict[str, set[str]], root: Path | None = None
    ) -> None:
        # requirements: extra → the distributions it declares ("" for the dependencies).
        self.available = set(ALWAYS)
        for extra in {"", *extras}:
            self.available |= {IMPORT_NAMES.get(d, d) for d in requirements.get(extra, set())}
        self.modules = modules(root)
        self.parsed = {name: imports_of(name, path) for name, path in self.modules.items()}
        self.memo: dict[str, bool] = {}
        self.undeclared: set[str] = set()

    def loads(self, name: str) -> bool:
        """Whether importing this dotted name would work."""
        for prefix, version in DJANGO_FROM.items():
            if name == prefix or name.startswith(prefix + "."):
                import django

                return django.VERSION[:2] >= version
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            parent = name.rpartition(".")[0]
            own = name if name in self.modules else parent  # "from pkg.mod import object"
            return (not parent or self.importable(parent)) and self.importable(own)
        top = third_party(name)
        if top is None:
            return True
        if top not in set(IMPORT_NAMES.values()) | ALWAYS:
            # Declared by nothing: imported all the same, so that the walk shows what a
            # project without it gets, and then fails.
            self.undeclared.add(top)
            return True
        return top in self.available

    def importable(self, name: str) -> bool:
        if name not in self.memo:
            self.memo[name] = True  # an import cycle is not a missing module
            found = self.parsed[name]
            self.memo[name] = all(self.loads(n) for n in found.needed) and all(
                all(self.loads(n) for n in tried) or all(self.loads(n) for n in fallback)
                for tried, fallback in found.alternatives
            )
        return self.memo[name]


def installed_requirements() -> dict[str, set[str]]:
    """The installed wheel's Requires-Dist, by extra."""
    import importlib.metadata
    import re

    by_extra: dict[str, set[str]] = {}
    for line in importlib.metadata.requires("django-idempotency") or []:
        name = re.match(r"[A-Za-z0-9._-]+", line)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", line)
        assert name is not None
        canonical = re.sub(r"[-_.]+", "-", name.group()).lower()
        by_extra.setdefault(extra.group(1) if extra else "", set()).add(canonical)
    return by_extra


def walk(extras: list[str]) -> int:
    import django

    django.setup()
    plan = Walk(set(extras), installed_requirements())
    left_out = sorted(name for name in plan.modules if not plan.loads(name))
    done, failed = 0, []
    for name in plan.modules:
        if name in left_out:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed.append(f"import walk: FAIL {name}: {type(exc).__name__}: {exc}")
        else:
            done += 1
    print(
        f"import walk ({','.join(extras) or 'no extra'}, Django {django.get_version()}): "
        f"imported {done} modules; {len(left_out)} need other extras"
        + (f" ({', '.join(n.removeprefix(PACKAGE + '.') for n in left_out)})" if left_out else "")
    )
    failed += [
        f"import walk: FAIL {top} is imported but no extra declares it"
        for top in sorted(plan.undeclared)
    ]
    if failed:
        print("\n".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["walk"]:
        raise SystemExit(__doc__)
    sys.exit(walk(sys.argv[2:]))
