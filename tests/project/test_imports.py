"""What the package imports, read from its source: every import is of the standard library,
Django (and what Django requires) or a distribution that pyproject.toml declares, and no class
that is generic only in the stubs is subscripted at run time. Both held only by accident in the
test environment: Celery brought typing_extensions, and django-tasks' call of
django_stubs_ext.monkeypatch() made Django's Task subscriptable (issue 28)."""

from __future__ import annotations

import ast
import builtins
import importlib.metadata
import re
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from tests.support import imports
from tests.support.imports import modules, parse, runtime_statements, third_party

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = ROOT / "django_idempotency"
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> dict[str, set[str]]:
    """Extra ("" for the dependencies) → the distributions it declares."""
    extras = {"": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}
    return {
        extra: {canonical(Requirement(line).name) for line in lines}
        for extra, lines in extras.items()
    }


def allowed_distributions() -> set[str]:
    """Declared somewhere, or Django's own requirements (asgiref, sqlparse)."""
    django = {
        canonical(Requirement(line).name)
        for line in importlib.metadata.requires("django") or []
        if "extra ==" not in line
    }
    return {d for ds in declared_distributions().values() for d in ds} | django | {"django"}


def undeclared_imports(root: Path) -> list[str]:
    """Every import outside ``if TYPE_CHECKING:`` whose distribution nothing declares."""
    owners = importlib.metadata.packages_distributions()
    allowed = allowed_distributions()
    problems = []
    for name, path in modules(root).items():
        tops = {third_party(module) for module in imports.imports_of(name, path).everything()}
        for top in sorted(tops - {None}):
            # Not installed here (an extra this environment lacks): the walk's table names it.
            distributions = {canonical(d) for d in owners.get(top, [])} or {
                d for d, name in imports.IMPORT_NAMES.items() if name == top
            }
            if not distributions & allowed:
                where = ", ".join(sorted(distributions)) or "not installed"
                problems.append(f"{name} imports {top} ({where}): declared by no extra")
    return sorted(set(problems))


# Subscripts that are fine at run time: builtins (list[int]), the standard library's generics
# (typing, collections.abc, contextvars) and the package's own Generic/Protocol classes.
FINE_ROOTS = set(dir(builtins))


class Origins:
    """Where each module-level name of a module comes from, outside TYPE_CHECKING."""

    def __init__(self, root: Path) -> None:
        self.modules = modules(root)
        self.trees = {name: parse(path) for name, path in self.modules.items()}
        self.memo: dict[tuple[str, str], str | None] = {}

    def bindings(self, module: str) -> Iterator[tuple[str, ast.stmt, str | None]]:
        """(name, statement, imported from) for each binding at import time."""

        def walk(body: list[ast.stmt]) -> Iterator[tuple[str, ast.stmt, str | None]]:
            for statement in runtime_statements(body):
                if isinstance(statement, ast.ImportFrom) and statement.module:
                    for alias in statement.names:
                        source = f"{statement.module}.{alias.name}"
                        yield alias.asname or alias.name, statement, source
                elif isinstance(statement, ast.Import):
                    for alias in statement.names:
                        yield (alias.asname or alias.name.split(".")[0]), statement, alias.name
                elif isinstance(statement, ast.ClassDef):
                    yield statement.name, statement, None
                elif isinstance(statement, ast.If | ast.Try):
                    yield from walk(statement.body + statement.orelse)
                    for handler in getattr(statement, "handlers", []):
                        yield from walk(handler.body)

        yield from walk(self.trees[module].body)

    def third_party_class(self, module: str, name: str, depth: int = 0) -> str | None:
        """What a subscript of ``name`` in ``module`` fails on at run time, if anything: a
        third-party class (its dotted origin), or the package's own class that is not generic."""
        key = (module, name)
        if key in self.memo or depth > 10:
            return self.memo.get(key)
        self.memo[key] = None
        for bound, statement, source in self.bindings(module):
            if bound != name:
                continue
            if source is None:
                assert isinstance(statement, ast.ClassDef)
                if not self.generic(module, statement):
                    self.memo[key] = f"{module}.{name} (not generic)"
            elif source.startswith(imports.PACKAGE):
                owner, _, attribute = source.rpartition(".")
                if owner in self.trees:
                    found = self.third_party_class(owner, attribute, depth + 1)
                    self.memo[key] = self.memo[key] or found
            elif third_party(source) is not None:
                self.memo[key] = source
        return self.memo[key]

    def generic(self, module: str, node: ast.ClassDef) -> bool:
        """Whether the package's own class takes a subscript: it derives from Generic or
        Protocol, or from a class of the package that does."""
        for base in node.bases:
            target = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(target, ast.Attribute | ast.Name):
                label = target.attr if isinstance(target, ast.Attribute) else target.id
                if label in ("Generic", "Protocol"):
                    return True
            if isinstance(target, ast.Name) and self.own_generic(module, target.id):
                return True
        return False

    def own_generic(self, module: str, name: str, depth: int = 0) -> bool:
        for bound, statement, source in self.bindings(module):
            if bound != name or depth > 10:
                continue
            if isinstance(statement, ast.ClassDef) and self.generic(module, statement):
                return True
            if source and source.startswith(imports.PACKAGE):
                owner, _, attribute = source.rpartition(".")
                if owner in self.trees and self.own_generic(owner, attribute, depth + 1):
                    return True
        return False


def evaluated_at_import(body: list[ast.stmt], annotations: bool) -> Iterator[ast.AST]:
    """The expressions Python evaluates when the module is imported: not function bodies, not
    TYPE_CHECKING blocks, not annotations under ``from __future__ import annotations``."""
    for statement in runtime_statements(body):
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from statement.decorator_list
            yield from statement.args.defaults
            yield from (d for d in statement.args.kw_defaults if d is not None)
            if annotations:
                yield from (
                    a.annotation
                    for a in ast.walk(statement.args)
                    if isinstance(a, ast.arg) and a.annotation
                )
                yield from [statement.returns] if statement.returns else []
        elif isinstance(statement, ast.ClassDef):
            yield from [*statement.decorator_list, *statement.bases]
            yield from (k.value for k in statement.keywords)
            yield from evaluated_at_import(statement.body, annotations)
        elif isinstance(statement, ast.AnnAssign):
            if statement.value is not None:
                yield statement.value
            if annotations:
                yield statement.annotation
        elif isinstance(statement, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for field in ("test", "iter", "items"):
                value = getattr(statement, field, None)
                yield from value if isinstance(value, list) else [value] if value else []
            for field in ("body", "orelse", "finalbody"):
                yield from evaluated_at_import(getattr(statement, field, []), annotations)
            for handler in getattr(statement, "handlers", []):
                yield from evaluated_at_import(handler.body, annotations)
        else:
            yield statement


def runtime_subscripts(root: Path) -> list[str]:
    """Every subscript, evaluated at import, of a class that takes no subscript at run time."""
    origins = Origins(root)
    problems = []
    for module, tree in origins.trees.items():
        future = any(isinstance(s, ast.ImportFrom) and s.module == "__future__" for s in tree.body)
        for expression in evaluated_at_import(tree.body, annotations=not future):
            for node in ast.walk(expression):
                if not isinstance(node, ast.Subscript):
                    continue
                target = node.value
                while isinstance(target, ast.Attribute):
                    target = target.value
                if not isinstance(target, ast.Name) or target.id in FINE_ROOTS:
                    continue
                culprit = origins.third_party_class(module, target.id)
                if culprit:
                    problems.append(
                        f"{module}:{node.lineno}: {ast.unparse(node)} subscripts {culprit} "
                        "at run time (only under TYPE_CHECKING)"
                    )
    return problems


def test_every_import_is_of_a_declared_distribution() -> None:
    assert undeclared_imports(PACKAGE_ROOT) == []


def test_no_class_generic_only_in_its_stubs_is_subscripted_at_run_time() -> None:
    assert runtime_subscripts(PACKAGE_ROOT) == []


def test_the_walk_knows_each_declared_distribution_by_its_import_name() -> None:
    # .ci/release-check's cells have only some extras installed: the walk's table stands in
    # for importlib.metadata there, and must say what the distributions really provide.
    owners = importlib.metadata.packages_distributions()
    optional = {d for e, ds in declared_distributions().items() if e for d in ds}
    assert set(imports.IMPORT_NAMES) == optional
    installed = {canonical(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    for distribution, top in imports.IMPORT_NAMES.items():
        if distribution in installed:  # the others: where the test environment has them
            assert distribution in {canonical(d) for d in owners.get(top, [])}, (distribution, top)


BROKEN = {
    # ee437ef's two defects, and the other shapes the guards must see.
    "task_backend.py": "from typing_extensions import ParamSpec\n",
    "frameworks.py": "from django.tasks import Task\n",
    "runner.py": textwrap.dedent(
        """
        from __future__ import annotations
        from typing import TYPE_CHECKING, Any
        from celery import Task as CeleryTask
        from pkg.frameworks import Task
        if TYPE_CHECKING:
            from typing_extensions import Self  # types only: fine
            Fine = Task[..., Any]
        class _Deliver(Task[..., Any]):
            pass
        class Consumer(CeleryTask[Any, Any]):
            pass
        Alias = Task[int, int]
        class Mine:
            pass
        Local = Mine[int]
        def later():
            return Task[int, int]  # in a function: not at import
        ok: list[int] = [1]
        """
    ),
}


def test_the_guards_see_the_shapes_of_issue_28(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in BROKEN.items():
        (package / name).write_text(source)
    owners = importlib.metadata.packages_distributions()
    assert "typing_extensions" in owners  # installed here: it is the declaring that is missing
    monkeypatch.setattr(imports, "PACKAGE", "pkg")
    assert undeclared_imports(package) == [
        "pkg.task_backend imports typing_extensions (typing-extensions): declared by no extra"
    ]
    assert runtime_subscripts(package) == [
        "pkg.runner:9: Task[..., Any] subscripts django.tasks.Task at run time "
        "(only under TYPE_CHECKING)",
        "pkg.runner:11: CeleryTask[Any, Any] subscripts celery.Task at run time "
        "(only under TYPE_CHECKING)",
        "pkg.runner:13: Task[int, int] subscripts django.tasks.Task at run time "
        "(only under TYPE_CHECKING)",
        "pkg.runner:16: Mine[int] subscripts pkg.runner.Mine (not generic) at run time "
        "(only under TYPE_CHECKING)",
    ]


def test_the_walk_leaves_out_only_what_an_absent_extra_provides() -> None:
    # With every extra, every module of the package is imported by the walk.
    extras = set(PROJECT["optional-dependencies"])
    plan = imports.Walk(extras, declared_distributions(), PACKAGE_ROOT)
    assert [n for n in plan.modules if not plan.loads(n)] == []
    bare = imports.Walk(set(), declared_distributions(), PACKAGE_ROOT)
    left_out = {n for n in bare.modules if not bare.loads(n)}
    assert "django_idempotency.messaging.consumers.celery" in left_out  # Celery
    assert "django_idempotency.rest_framework" in left_out
    assert "django_idempotency.decorators" not in left_out  # DRF only if installed
    assert "django_idempotency.models" not in left_out


def test_each_module_is_importable_with_one_extra() -> None:
    # contrib/spectacular imports DRF as well as drf-spectacular: an extra that brought DRF only
    # through drf-spectacular would leave DRF's floor undeclared for it.
    declared = declared_distributions()
    plans = [imports.Walk({extra} - {""}, declared, PACKAGE_ROOT) for extra in declared]
    names = plans[0].modules
    assert [n for n in names if not any(plan.loads(n) for plan in plans)] == []
