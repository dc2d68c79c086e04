"""What the release declares and ships: pyproject.toml against tox.ini, the README as the package
page, the lowest versions' constraints. Building and installing the wheel: .ci/release-check."""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT: dict[str, Any] = PYPROJECT["project"]
README = (ROOT / "README.md").read_text()


def tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return parser


def declared() -> list[Requirement]:
    """The dependencies and every extra's, as the wheel's metadata lists them."""
    extras = [line for lines in PROJECT["optional-dependencies"].values() for line in lines]
    return [Requirement(line) for line in [*PROJECT["dependencies"], *extras]]


def floor(requirement: Requirement) -> str:
    (lowest,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return lowest


def classified(prefix: str) -> set[str]:
    return {
        c.removeprefix(prefix)
        for c in PROJECT["classifiers"]
        if re.fullmatch(rf"{re.escape(prefix)}\d+\.\d+", c)
    }


def test_the_classifiers_declare_the_python_and_django_versions_tox_tests() -> None:
    env_list = tox()["tox"]["env_list"]
    pythons = {f"{m[0]}.{m[1:]}" for m in re.findall(r"\bpy(3\d+)", env_list)}
    # "django52-beat" and "django{61, 60-beat}"
    factors = re.findall(r"django(\d\d)", env_list) + [
        factor.strip()[:2]
        for group in re.findall(r"django\{([^}]*)\}", env_list)
        for factor in group.split(",")
    ]
    djangos = {f"{m[0]}.{m[1]}" for m in factors}
    assert classified("Programming Language :: Python :: ") == pythons == {"3.11", "3.12", "3.13"}
    assert classified("Framework :: Django :: ") == djangos == {"5.2", "6.0", "6.1"}
    assert PROJECT["requires-python"] == f">={min(pythons)}"
    (django,) = [r for r in declared() if r.name == "django"]
    assert floor(django) == min(djangos)


def test_topics_keywords_and_the_licence_expression_are_declared() -> None:
    assert any(c.startswith("Topic :: ") for c in PROJECT["classifiers"])
    assert "idempotency" in PROJECT["keywords"]
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    # hatchling 1.26 wrote no License-Expression field into the metadata; 1.27 does.
    (hatchling,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    assert hatchling.name == "hatchling" and floor(hatchling) == "1.27"


def test_the_celery_extra_never_holds_django_back_and_the_driver_is_plain() -> None:
    extras = {
        name: {Requirement(line).name: Requirement(line) for line in lines}
        for name, lines in PROJECT["optional-dependencies"].items()
    }
    # django-celery-beat caps Django (2.9: below 6.1): only the beat extra may bring it.
    assert [name for name, reqs in extras.items() if "django-celery-beat" in reqs] == ["beat"]
    assert "celery" in extras["celery"] and "celery" in extras["beat"]
    # Which libpq psycopg uses (its binary or c extra) is the project's choice.
    assert extras["postgres"]["psycopg"].extras == set()


def test_the_lowest_constraints_pin_exactly_the_declared_floors() -> None:
    lines = (ROOT / ".ci" / "constraints-lowest.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    floors = {r.name: Version(floor(r)) for r in declared()}
    assert {name: Version(pin) for name, pin in pins.items()} == floors


def test_the_lowest_env_runs_test_files_that_exist() -> None:
    commands = tox()["testenv:lowest"]["commands"]
    paths = re.findall(r"tests/\S+\.py", commands)
    assert paths and [p for p in paths if not (ROOT / p).is_file()] == []


def test_the_sdist_holds_what_runs_the_tests_and_anchors_its_patterns() -> None:
    include = PYPROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    # An unanchored "README.md" also matched bench/README.md.
    assert all(pattern.startswith("/") for pattern in include)
    for needed in ("/django_idempotency", "/tests", "/testproject", "/docs", "/tox.ini"):
        assert needed in include
    assert {"/README.md", "/CHANGELOG.md", "/LICENSE"} <= set(include)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_links_are_absolute_and_share_one_project_url() -> None:
    source = PROJECT["urls"]["Source"]
    links = LINK.findall(README)
    assert links
    relative = [link for link in links if not re.match(r"https?://|#", link)]
    assert relative == [], "relative links break on the package page"
    # Links into the repository all start with the one project URL of pyproject.toml.
    project = [link for link in links if "django-idempotency" in link]
    assert project and [link for link in project if not link.startswith(source)] == []
    assert all(url.startswith(source) for url in PROJECT["urls"].values())


@pytest.mark.parametrize(
    "text", ["/root/", "/work/", "/home/", "/Users/", "not on PyPI", "path/to/", "git+<"]
)
def test_the_readme_names_no_machine_path_or_placeholder(text: str) -> None:
    assert text not in README


def test_the_changelog_dates_the_version_being_released() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", changelog, re.MULTILINE)
    assert f"{PROJECT['version']} (" in " ".join(headings)
    (released,) = [h for h in headings if h.startswith(PROJECT["version"])]
    assert re.fullmatch(r"\d+\.\d+\.\d+ \(\d{4}-\d\d-\d\d\)", released)


def test_before_the_first_upload_the_first_version_is_what_main_is() -> None:
    # Nothing is uploaded while the project's address is a placeholder (releasing.md): a
    # change then belongs in the first version's section, not under "Unreleased" above a
    # version that would contradict main. After the first upload, "Unreleased" is the place.
    if "example.org" not in PROJECT["urls"]["Source"]:
        pytest.skip("uploaded: changes after a release go under Unreleased")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", changelog, re.MULTILINE)
    assert headings[0].startswith(f"{PROJECT['version']} ("), headings[0]


def tox_envs() -> list[str]:
    """tox.ini's env_list, its braces expanded ("py312-django{61, 60}-tasks": two)."""
    envs: list[str] = []
    for entry in re.split(r"\s*\n\s*", tox()["tox"]["env_list"].strip()):
        match = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", entry)
        factors = [f.strip() for f in match[2].split(",")] if match else [""]
        envs += [f"{match[1]}{f}{match[3]}" if match else entry for f in factors]
    return envs


def test_ci_runs_every_environment_the_env_list_declares() -> None:
    # Declare only what CI runs: each env of env_list is a tox run of .ci/run, but the
    # README's command, which .ci/run runs as written in a Python 3.11 / Django 5.2 .venv.
    ci = (ROOT / ".ci" / "run").read_text()
    ran = set(re.findall(r"^\s*tox_env (\S+)", ci, re.MULTILINE))
    envs = set(tox_envs())
    assert envs - ran == {"py311-django52-beat"}
    assert ran <= envs
    assert 'bash -c "$TEST_COMMAND"' in ci and "python3 -m venv .venv" in README
    # py311-django52-beat runs as the README does: the same workers.
    (workers,) = re.findall(r"pytest (-n \d+ --dist loadfile)", README)
    assert workers in tox()["testenv"]["commands"]


def test_the_lowest_env_runs_the_optional_wings() -> None:
    commands = tox()["testenv:lowest"]["commands"]
    for module in (
        "tests/messaging/test_nats.py",  # nats
        "tests/messaging/test_trace_context.py",  # tasks (the backport) and otel
        "tests/scenarios/test_asgi.py",
        "tests/operators/test_telemetry.py",
        "tests/scenarios/test_encrypted_at_rest.py",  # encryption
    ):
        assert module in commands
    extras = tox()["testenv:lowest"]["extras"].split()
    assert set(extras) == set(PROJECT["optional-dependencies"]) - {"adrf", "celery"}


@pytest.mark.parametrize("page", ["README.md", "docs/installation.md"])
def test_the_extras_tables_list_every_extra(page: str) -> None:
    text = (ROOT / page).read_text()
    listed = set(re.findall(r"^\| `([a-z]+)` \|", text, re.MULTILINE))
    assert listed == set(PROJECT["optional-dependencies"])


def test_every_pip_install_of_the_package_names_the_wheel_built_from_a_clone() -> None:
    # Nothing is uploaded yet: "pip install django-idempotency[...]" would fail or install
    # someone else's package.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wheel = f"dist/django_idempotency-{PROJECT['version']}-py3-none-any.whl"
    bad = []
    for page in pages:
        if page.name == "changelog.md":
            continue
        for line in page.read_text().splitlines():
            if re.search(r"pip install .*django[-_]idempotency(?!-)", line) and wheel not in line:
                bad.append(f"{page.name}: {line.strip()}")
    assert bad == []


def test_the_maintainers_can_be_reached_where_security_md_says() -> None:
    (maintainer,) = PROJECT["maintainers"]
    domain = maintainer["email"].split("@")[1]
    security = (ROOT / "SECURITY.md").read_text()
    assert re.search(rf"\b[a-z]+@{re.escape(domain)}\b", security)


def test_releasing_md_names_every_file_that_holds_the_placeholder_address() -> None:
    # Settling the address before the first upload is one list to work through: each file
    # naming the project's host is in it, and holds only the project URL or its contacts.
    source = PROJECT["urls"]["Source"]
    host = re.sub(r"^https?://|/.*$", "", source)
    (maintainer,) = PROJECT["maintainers"]
    domain = maintainer["email"].split("@")[1]
    releasing = (ROOT / "docs" / "releasing.md").read_text()
    published = ["README.md", "pyproject.toml", "SECURITY.md", "CONTRIBUTING.md"]
    published += [str(p.relative_to(ROOT)) for p in sorted((ROOT / ".github").rglob("*.*"))]
    published += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))]
    holding = []
    for name in published:
        text = (ROOT / name).read_text()
        urls = re.findall(rf"https?://{re.escape(host)}\S*", text)
        addresses = re.findall(rf"[\w.-]+@[\w.-]*{re.escape(host)}", text)
        if not urls and not addresses:
            continue
        holding.append(name)
        assert [u for u in urls if not u.startswith(source)] == [], name
        assert [a for a in addresses if not a.endswith("@" + domain)] == [], name
    assert {"README.md", "pyproject.toml", "SECURITY.md"} <= set(holding)
    assert [name for name in holding if f"`{name}`" not in releasing] == []


def test_the_issue_templates_link_into_the_one_project_url() -> None:
    source = PROJECT["urls"]["Source"]
    config = (ROOT / ".github" / "ISSUE_TEMPLATE" / "config.yml").read_text()
    urls = re.findall(r"url: (\S+)", config)
    assert urls and [url for url in urls if not url.startswith(source)] == []
