"""The import contracts in pyproject.toml say all of LAYOUT.md, and each rule bites: the tree
as it is keeps every contract, and a copy of the package with one deliberate wrong move (a
wing removed, a module nobody placed, the foundation's modules importing each other, storage
or the engine reaching partitions, the chain's sub-wings out of their order) breaks the
contract that says so. The copies live in a temporary directory; lint-imports takes well
under a second on each."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    command = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    return subprocess.run(
        [sys.executable, "-c", command, "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package and its pyproject.toml, to be broken on purpose."""
    shutil.copytree(
        ROOT / "django_idempotency",
        tmp_path / "django_idempotency",
        ignore=shutil.ignore_patterns("__pycache__", "locale", "static", "templates"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_package_keeps_every_contract() -> None:
    found = lint_imports(ROOT)
    assert found.returncode == 0, found.stdout + found.stderr
    assert " 0 broken" in found.stdout


@pytest.mark.parametrize(
    ("wrong", "broken", "says"),
    [
        pytest.param(
            lambda p: add_line(p / "conf.py", "from django_idempotency import models"),
            "The wings",
            "django_idempotency.conf is not allowed to import django_idempotency.models",
            id="foundation modules import each other",
        ),
        pytest.param(
            lambda p: (p / "newwing.py").write_text("VALUE = 1\n"),
            "The wings",
            "django_idempotency.newwing",
            id="a module no layer lists (exhaustive)",
        ),
        pytest.param(
            lambda p: add_line(
                p / "storage" / "bodies.py", "from django_idempotency.partitions import tables"
            ),
            "Storage and the engine never reach partitions",
            "django_idempotency.storage is not allowed to import",
            id="storage imports partitions",
        ),
        pytest.param(
            lambda p: add_line(
                p / "engine" / "hashing.py", "from django_idempotency.partitions import tables"
            ),
            "Storage and the engine never reach partitions",
            "django_idempotency.engine.hashing -> django_idempotency.partitions.tables",
            id="the engine imports partitions",
        ),
        pytest.param(
            lambda p: add_line(
                p / "messaging" / "relay" / "loop.py",
                "from django_idempotency.messaging import task_backend",
            ),
            "The chain's sub-wings",
            "django_idempotency.messaging.relay is not allowed to import "
            "django_idempotency.messaging.task_backend",
            id="the chain imports a first path kept for projects",
        ),
        pytest.param(
            lambda p: add_line(
                p / "messaging" / "tracing.py", "from django_idempotency.messaging import outbox"
            ),
            "The chain's sub-wings",
            "django_idempotency.messaging.tracing is not allowed to import "
            "django_idempotency.messaging.outbox",
            id="a shared module of the chain imports a sub-wing",
        ),
        pytest.param(
            lambda p: (p / "messaging" / "newpart.py").write_text("VALUE = 1\n"),
            "The chain's sub-wings",
            "django_idempotency.messaging.newpart",
            id="a module of the chain no layer lists (exhaustive)",
        ),
        pytest.param(
            lambda p: add_line(
                p / "messaging" / "consumers" / "tasks.py",
                "from django_idempotency.messaging.relay import loop",
            ),
            "Consumers never reach the outbox",
            "django_idempotency.messaging.consumers.tasks -> "
            "django_idempotency.messaging.relay.loop",
            id="a consumer imports the relay",
        ),
        pytest.param(
            lambda p: add_line(
                p / "messaging" / "outbox" / "tasks.py",
                "from django_idempotency.messaging.destinations import tasks",
            ),
            "The chain's sub-wings",
            "django_idempotency.messaging.outbox is not allowed to import "
            "django_idempotency.messaging.destinations",
            id="the outbox imports a destination (up)",
        ),
    ],
)
def test_a_wrong_import_breaks_the_contract_that_forbids_it(
    tree: Path, wrong: Callable[[Path], object], broken: str, says: str
) -> None:
    wrong(tree / "django_idempotency")

    found = lint_imports(tree)

    assert found.returncode == 1, found.stdout + found.stderr
    # The contract's line in the summary, then the offending import in its report.
    assert any(
        line.startswith(broken) and " BROKEN" in line for line in found.stdout.splitlines()
    ), found.stdout
    assert says in " ".join(found.stdout.split()), found.stdout


def test_a_wing_that_is_gone_fails_rather_than_passing_in_silence(tree: Path) -> None:
    # No layer is optional: without the parentheses a removed or renamed wing is an error.
    (tree / "django_idempotency" / "beat.py").unlink()

    found = lint_imports(tree)

    assert found.returncode != 0
    assert "module django_idempotency.beat does not exist" in " ".join(
        (found.stdout + found.stderr).split()
    )
