"""The docs stay true to the code: every setting, check id, per-view option, problem type and
signal is documented, and the docs name no setting or check id that does not exist."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
from django.dispatch import Signal

from django_idempotency import signals
from django_idempotency.conf import Settings
from django_idempotency.engine import errors as exceptions
from django_idempotency.http.options import ViewOptions
from django_idempotency.partitions.apply import create_partition_statements
from django_idempotency.partitions.tables import RECORDS
from django_idempotency.rest_framework import IdempotencyMixin
from tests.conftest import unmeasured

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CHECKS_PACKAGE = ROOT / "django_idempotency" / "checks"
CHECK_ID = re.compile(r"django_idempotency\.[EW]\d{3}")
SETTING_NAME = re.compile(r"\bIDEMPOTENCY_[A-Z0-9_]+")

SETTINGS = sorted(name for name, value in vars(Settings).items() if isinstance(value, property))


def page(name: str) -> str:
    return (DOCS / name).read_text()


def all_pages() -> str:
    sources = [p for p in DOCS.rglob("*") if p.suffix in {".md", ".rst"}]
    return "\n".join(p.read_text() for p in sources if "_build" not in p.parts)


def defined_check_ids() -> set[str]:
    sources = (module.read_text() for module in sorted(CHECKS_PACKAGE.glob("*.py")))
    return set(CHECK_ID.findall("\n".join(sources)))


def test_settings_are_found_in_conf():
    # Guards the tests below against a change in how conf.py declares settings.
    assert "TTL" in SETTINGS and "HEADER" in SETTINGS


@pytest.mark.parametrize("name", SETTINGS)
def test_every_setting_has_a_typed_heading_on_the_settings_page(name):
    heading = re.compile(rf"^#+ `IDEMPOTENCY_{name}: [^`]+`$", re.MULTILINE)
    assert heading.search(page("settings.md")), f"settings.md lacks `IDEMPOTENCY_{name}: type`"


# Other packages' settings (and one error code), which the migration guide sets side by side
# with ours.
FOREIGN_SETTINGS = {
    "IDEMPOTENCY_KEY",  # django-idempotency-key's dict
    "IDEMPOTENCY_KEY_CLEANUP_INTERVAL_HOURS",  # drf-idempotencykey
    "IDEMPOTENCY_KEY_EXEMPT_PATH_RE",
    "IDEMPOTENCY_KEY_EXPIRATION_MINUTES",
    "IDEMPOTENCY_KEY_HEADER",
    "IDEMPOTENCY_KEY_IN_USE_WITH_DIFFERENT_REQUEST",
    "IDEMPOTENCY_KEY_MAX_BODY_SIZE",
    "IDEMPOTENCY_KEY_METHODS",
    "IDEMPOTENCY_KEY_REQUIRED",
    "IDEMPOTENCY_KEY_RETRY_AFTER_SECONDS",
    "IDEMPOTENCY_KEY_LOCK_TIMEOUT",  # djangorestframework-idempotency-key
}
# The misspelling that the docs of check W020 show.
MISSPELT_SETTINGS = {"IDEMPOTENCY_REQUIRD"}


def test_docs_name_no_setting_that_does_not_exist():
    ours = {f"IDEMPOTENCY_{name}" for name in SETTINGS}
    assert not ours & FOREIGN_SETTINGS
    migrating = page("migrating.md")
    mentioned = set(SETTING_NAME.findall(all_pages().replace(migrating, "")))
    assert mentioned, "no setting found in the docs at all"
    assert mentioned - ours - MISSPELT_SETTINGS == set()
    assert set(SETTING_NAME.findall(migrating)) - ours - FOREIGN_SETTINGS == set()


def test_every_check_id_is_documented():
    ids = defined_check_ids()
    assert ids, "the checks define no check ids"
    assert ids - set(CHECK_ID.findall(page("checks.md"))) == set()


def test_troubleshooting_has_a_section_for_every_check_id_and_problem_type():
    sections = set(re.findall(r"^### `([^`]+)`", page("troubleshooting.md"), re.MULTILINE))
    ids = defined_check_ids()
    assert ids, "the checks define no check ids"
    assert ids - sections == set()
    assert {problem.name for problem in PROBLEMS} - sections == set()


def test_docs_name_no_check_id_that_does_not_exist():
    assert set(CHECK_ID.findall(all_pages())) - defined_check_ids() == set()


MIXIN_OPTIONS = sorted(name for name in vars(IdempotencyMixin) if name.startswith("idempotency_"))
# Both come from one declaration, http.options.ViewOptions.
DECORATOR_OPTIONS = sorted(ViewOptions.__annotations__)


def test_per_view_options_are_found():
    assert "idempotency_ttl" in MIXIN_OPTIONS and "ttl" in DECORATOR_OPTIONS


@pytest.mark.parametrize("name", MIXIN_OPTIONS + DECORATOR_OPTIONS)
def test_every_per_view_option_is_in_the_settings_table(name):
    assert re.search(rf"^\|.*`{name}`.*\|$", page("settings.md"), re.MULTILINE)


def test_settings_table_names_no_option_that_does_not_exist():
    named = set(re.findall(r"`(idempotency_\w+)`", page("settings.md")))
    assert named, "the settings page names no per-view attribute"
    assert named - set(MIXIN_OPTIONS) == set()


PROBLEMS = [
    cls
    for cls in vars(exceptions).values()
    if isinstance(cls, type)
    and issubclass(cls, exceptions.IdempotencyError)
    and cls is not exceptions.IdempotencyError
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda cls: cls.name)
def test_every_problem_type_is_documented_with_status_title_and_stripe_code(problem):
    errors = page("errors.md")
    section = errors.split(f"\n## {problem.name}\n", 1)
    assert len(section) == 2, f"errors.md has no section `## {problem.name}`"
    body = section[1].split("\n## ", 1)[0]
    assert f'"type": "urn:django-idempotency:{problem.name}"' in body
    assert f'"title": "{problem.title}"' in body
    assert f'"status": {problem.status}' in body
    stripe_row = f"| `{problem.name}` | {problem.stripe_status} | `{problem.stripe_type}` |"
    assert stripe_row in errors
    if problem.stripe_code:
        assert f'"code": "{problem.stripe_code}"' in errors


SIGNALS = sorted(name for name, value in vars(signals).items() if isinstance(value, Signal))


@pytest.mark.parametrize("name", SIGNALS)
def test_every_signal_has_a_section(name):
    assert f"\n### `{name}`\n" in page("signals.md")


def test_partition_ddl_shown_is_what_the_code_runs():
    shown = page("partitions.md")
    for statement in create_partition_statements(RECORDS, date(2026, 11, 22)):
        assert f"{statement};" in shown
    migration = importlib.import_module("django_idempotency.migrations.0001_initial")
    assert migration.KEY_SCOPE_INDEX in shown


def test_docs_build_without_warnings(tmp_path):
    if importlib.util.find_spec("sphinx") is None:
        pytest.skip("Sphinx is not installed (the `docs` dependency group)")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-E",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(tmp_path),
        ],
        # Not traced by coverage.py: autodoc only imports the package, as every test does,
        # and tracing Sphinx doubles the build's time.
        env=unmeasured(os.environ),
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    assert (tmp_path / "settings.html").exists()
    # The API reference was generated from the code, not left empty by a failed import.
    api = (tmp_path / "api.html").read_text()
    for name in (
        "django_idempotency.rest_framework.IdempotencyMixin",
        "django_idempotency.decorators.idempotent",
        "django_idempotency.conf.Settings.PRINCIPAL_DISPLAY",
        # The messaging API and the probe (their extras' libraries are mocked: conf.py).
        "django_idempotency.messaging.outbox.enqueue_task",
        "django_idempotency.messaging.consumers.ExactlyOnceTask",
        "django_idempotency.messaging.destinations.Destination",
        "django_idempotency.messaging.nats_consumer.NatsConsumer",
        "django_idempotency.messaging.downstream.derive_key",
        "django_idempotency.probe.drive.probe",
    ):
        assert f'id="{name}"' in api, name


# The entries of promise, guard and test (docs/guards.md): each MUST of the contract's sections
# below names the test that fails when its guard is removed. A refactor that deletes or
# renames such a test fails here until an entry names its replacement.
GUARDED_SECTIONS = ("3", "4", "5", "6", "8", "12", "13", "15")
# `tests/wing/test_x.py::test_name`, `tests/test_x.py::TestCase::test_name`, with a parameter id.
TEST_REFERENCE = re.compile(r"`(tests/(?:\w+/)*\w+\.py)::((?:\w+::)?test_\w+)(?:\[[^\]`]*\])?`")
ENTRY = re.compile(r"\*\*(\d+a?)\.\d+\*\* (.*)")
PARTS = {"- Guard:": 2, "- Test:": 3, "- Removed:": 4}
NOT_BUILT = "(not built)"


def guard_rows() -> list[list[str]]:
    """The entries of guards.md, each as [section, promise, guard, test, removed]; a part's
    lines wrapped in the page are joined by a space."""
    rows: list[list[str]] = []
    current: list[str] | None = None
    part = 1
    for line in page("guards.md").splitlines():
        if entry := ENTRY.fullmatch(line):
            current = [entry[1], entry[2], "", "", ""]
            rows.append(current)
            part = 1
        elif current is None or not line.strip():
            continue
        elif line.startswith("#"):
            current = None
        elif starts := next((p for p in PARTS if line.startswith(p)), None):
            part = PARTS[starts]
            current[part] = line.removeprefix(starts).strip()
        else:  # a wrapped line of the promise or of the part above
            current[part] = f"{current[part]} {line.strip()}".strip()
    return rows


def guarded_tests() -> list[str]:
    cells = " ".join(row[3] for row in guard_rows())
    return sorted({"::".join(reference) for reference in TEST_REFERENCE.findall(cells)})


def test_the_guards_entries_are_found_with_all_their_parts():
    rows = guard_rows()
    assert len(rows) > 50, "guards.md has lost its entries"
    assert [row for row in rows if not all(row[1:])] == []


@pytest.mark.parametrize("row", guard_rows(), ids=lambda row: f"section {row[0]}")
def test_every_row_of_the_guards_table_names_a_test_or_says_why_not(row):
    section, _, guard, test, removed = row
    assert section in {str(n) for n in range(1, 16)} | {"8a"}, section
    if NOT_BUILT in test:
        return
    assert TEST_REFERENCE.search(test), f"no tests/<file>.py::<test> in {test!r}"
    assert guard and removed, row


@pytest.mark.parametrize("section", GUARDED_SECTIONS)
def test_every_guarded_section_has_a_row_with_a_test(section):
    assert any(row[0] == section and TEST_REFERENCE.search(row[3]) for row in guard_rows())


@pytest.mark.parametrize("reference", guarded_tests())
def test_every_test_named_in_the_guards_table_exists(reference):
    path, *names = reference.split("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    found: object = module
    for name in names:
        found = getattr(found, name, None)
    assert callable(found), f"{reference} is named in docs/guards.md but does not exist"


# The guard column names code as `path.py`: `name`, `Class.method` (a note in parentheses);
# each name up to the next `;`, the next path or the end of the enclosing parenthesis.
GUARD_MODULE = re.compile(r"`([\w/]+\.py)`:")
CODE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")


def _names_after(text: str) -> list[str]:
    """The backticked code names of the list that opens ``text``, its notes left out."""
    depth, kept = 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            if depth == 0:
                break  # the parenthesis this list was written in closes
            depth -= 1
        elif depth == 0:
            if char == ";":
                break
            kept.append(char)
    listed = re.split(r"`[\w/]+\.py`", "".join(kept))[0]
    return [name for name in re.findall(r"`([^`]+)`", listed) if CODE_NAME.fullmatch(name)]


def guard_code_names() -> list[tuple[str, str]]:
    """(module path, name) for each module and name the guard column of guards.md names."""
    found = set()
    for row in guard_rows():
        for module in GUARD_MODULE.finditer(row[2]):
            found |= {(module[1], name) for name in _names_after(row[2][module.end() :])}
    return sorted(found)


def defined_names(path: Path) -> set[str]:
    """What a module defines or imports: functions and classes (methods too), assigned names
    and attributes, parameters, imported names."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Name):
                        names.add(part.id)
                    elif isinstance(part, ast.Attribute):
                        names.add(part.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])  # `ParamSpec` from `typing`
    return names


def test_the_guards_table_names_code_in_most_rows() -> None:
    assert len(guard_code_names()) > 150, "the guard column's `path.py`: `name` form is lost"


@pytest.mark.parametrize(
    ("module", "name"), [pytest.param(*found, id=":".join(found)) for found in guard_code_names()]
)
def test_every_code_name_in_the_guards_table_exists(module: str, name: str) -> None:
    # Guards live under django_idempotency/; a few in the test project (repository-relative).
    path = next(
        (f for f in (ROOT / "django_idempotency" / module, ROOT / module) if f.is_file()), None
    )
    assert path is not None, f"docs/guards.md names {module}, which does not exist"
    missing = set(name.removesuffix("()").split(".")) - defined_names(path)
    assert not missing, f"docs/guards.md names {module}: {name}, which it does not define"


def _headers_in(sentence: str) -> set[str]:
    return {name.lower() for name in re.findall(r"`([A-Za-z-]+)`", sentence)}


def test_how_it_works_lists_the_replayed_and_the_never_stored_headers_of_the_code() -> None:
    from django_idempotency.http.request import NEVER_STORED_HEADERS, REPLAY_HEADERS

    text = " ".join(page("how-it-works.md").split())
    kept = text.split("response headers on an allow-list: ", 1)[1].split(", plus", 1)[0]
    never = text.split(".md#idempotency-replay-headers). ", 1)[1].split(" are never stored", 1)[0]
    assert _headers_in(kept) == REPLAY_HEADERS
    assert _headers_in(never) == NEVER_STORED_HEADERS


# how-it-works.md: "every SQL statement of the request path on the records' table" lives in
# storage/, and "every SQL statement the relay and the redrive run on the outbox rows" in
# messaging/outbox/leases.py. Read from the source: who names the table, its manager or a cursor.
REQUEST_PATH = ("engine", "http", "rest_framework.py", "decorators.py", "ninja.py", "contrib")
RELAY_SIDE = ("messaging/relay/loop.py", "messaging/relay/redrive.py", "messaging/destinations")


def _sources(*places: str) -> dict[str, str]:
    found = {}
    for place in places:
        path = ROOT / "django_idempotency" / place
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            found[str(file.relative_to(ROOT))] = file.read_text()
    return found


def test_the_request_path_runs_no_sql_on_the_records_table_outside_storage() -> None:
    assert "every SQL statement of the request path on the records' table" in " ".join(
        page("how-it-works.md").split()
    )
    touching = re.compile(r"IdempotencyRecord\.objects|\bRECORDS\b|django_idempotency_record\b")
    assert [name for name, text in _sources(*REQUEST_PATH).items() if touching.search(text)] == []


def test_the_relay_and_the_redrive_run_their_outbox_sql_through_leases() -> None:
    assert "Every SQL statement the relay and the redrive run on the outbox rows lives in " in (
        " ".join(page("how-it-works.md").split())
    )
    touching = re.compile(r"OutboxMessage\.objects|\.raw\(|cursor\(\)|\bTABLE\b")
    # The relay's LISTEN is no statement on the rows.
    executes = re.compile(r"\.execute\((?!f\"LISTEN )")
    found = _sources(*RELAY_SIDE)
    assert [n for n, text in found.items() if touching.search(text) or executes.search(text)] == []


# A figure goes stale in a module docstring unseen; the docs' Speed sections keep them.
MEASUREMENT = re.compile(r"\d\s*(?:µs|ms|ns)\b|\d+(?:\.\d+)?\u00d7|\b[Mm]easured\b")


def test_no_module_docstring_carries_a_benchmark_figure() -> None:
    import ast

    found = []
    for path in sorted((ROOT / "django_idempotency").rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if MEASUREMENT.search(docstring):
            found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_the_quickstarts_sample_charges_have_the_fields_the_demo_answers() -> None:
    from testproject.payments.serializers import ChargeSerializer

    answered = {*ChargeSerializer.Meta.fields, "capture"}  # capture: the demo's processor runs
    samples = [
        json.loads(line) for line in page("quickstart.md").splitlines() if line.startswith('{"id"')
    ]
    assert len(samples) >= 3
    assert [set(sample) for sample in samples] == [answered] * len(samples)


# The changelog page only includes CHANGELOG.md.
SUMMARISED = sorted(p.name for p in DOCS.glob("*.md") if p.name != "changelog.md")


@pytest.mark.parametrize("name", SUMMARISED)
def test_every_page_opens_with_a_summary_of_five_lines_at_most(name: str) -> None:
    # For a reader in a hurry: the title, then what the page gives them, before any detail.
    title, _, rest = page(name).partition("\n\n")
    assert title.startswith("# ") and "\n" not in title, name
    summary = rest.split("\n\n", 1)[0]
    assert not summary.startswith(("#", "```", "|")), f"{name} opens with no summary"
    assert len(summary.splitlines()) <= 5, f"{name}'s summary is longer than five lines"


# For a reader in a hurry: no sentence of prose runs past this many words. Code, tables,
# headings and link targets are not prose; an inline code span or a link counts as one word.
LONGEST_SENTENCE = 40
PROSE_PAGES = [*SUMMARISED, "../README.md", "../CONTRIBUTING.md"]
# Fenced blocks that hold prose; every other fence holds code, a toctree or reST.
PROSE_FENCES = ("{note}", "{warning}", "{tip}", "{important}", "{seealso}")
NOT_PROSE = re.compile(r"\s*(?:#|\||\[[^\]]+\]:\s|\([\w-]+\)=$|<!--|:\w+:)")
# A guard of guards.md is a list of code names, split by `;` for guard_code_names().
CODE_LISTS = ("- Guard:",)
STARTS_ITEM = re.compile(r"\s*(?:[-*+]|\d+\.)\s")
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')*]*\s+(?=[^a-z\s])")
WORD = re.compile(r"\w")
# Passages another change is rewriting, allowed until it lands (none now): a section
# by its heading, or a long sentence by its first words as long_sentences() gives it. An entry
# that no longer matches a long sentence fails, so the list only shrinks.
REWRITTEN_ELSEWHERE: dict[str, tuple[str, ...]] = {}


def prose_blocks(text: str) -> list[str]:
    """The paragraphs and list items of a Markdown page, code, tables and headings left out."""
    blocks: list[str] = []
    current: list[str] = []
    fence, in_note = "", False
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if fence:
            if stripped == fence:
                fence = ""
            continue
        fenced = stripped.startswith(("```", "~~~"))
        if fenced:
            # A note's own fences are no prose; every other fence opens code.
            if not stripped.endswith(PROSE_FENCES) and not (in_note and stripped == "```"):
                fence = stripped[:3]
            in_note = stripped.endswith(PROSE_FENCES)
        starts_item = STARTS_ITEM.match(line)
        if fenced or not stripped or starts_item or NOT_PROSE.match(line):
            if current:
                blocks.append(" ".join(current))
            current = [stripped] if starts_item else []
        else:
            current.append(stripped)
    return [block for block in blocks if not block.startswith(CODE_LISTS)]


def section_of(text: str, heading: str) -> str:
    """The section under ``heading``, up to the next heading of its level or above."""
    start = text.index(f"\n{heading}\n") + 1
    level = heading.split(" ", 1)[0]
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.MULTILINE).search(text, start + len(heading))
    return text[start : end.start() if end else len(text)]


def long_sentences(text: str) -> list[str]:
    found = []
    for block in prose_blocks(text):
        # A code span or a link is one word; a link's target is no word at all.
        block = re.sub(r"`[^`]*`", "CODE", block)
        block = re.sub(r"\]\([^)]*\)", "]", block)
        item = STARTS_ITEM.match(block)
        for sentence in SENTENCE_END.split(block[item.end() if item else 0 :]):
            if len([w for w in sentence.split() if WORD.search(w)]) > LONGEST_SENTENCE:
                found.append(sentence)
    return found


def test_long_sentences_are_found() -> None:
    # Guards the test below against a splitter that finds no sentence, or reads code as prose.
    long = f"Word {'word ' * 39}word."
    text = (
        f"# Title\n\nShort one. {long}\n\n- {long}\n\n```{{note}}\n{long}\n```\n\n"
        f"```python\n{'x ' * 50}\n```\n\n**Bold.** {long}\n"
    )
    assert long_sentences(text) == [long] * 4


@pytest.mark.parametrize("name", PROSE_PAGES)
def test_no_sentence_of_a_page_runs_past_forty_words(name: str) -> None:
    text = page(name)
    for entry in REWRITTEN_ELSEWHERE.get(name, ()):
        if entry.startswith("#"):
            section = section_of(text, entry)
            assert long_sentences(section), f"{name}: {entry!r} is short now: drop its entry"
            text = text.replace(section, "")
    found = long_sentences(text)
    allowed = tuple(e for e in REWRITTEN_ELSEWHERE.get(name, ()) if not e.startswith("#"))
    assert [start for start in allowed if not any(s.startswith(start) for s in found)] == []
    found = [sentence for sentence in found if not sentence.startswith(allowed)]
    assert found == [], f"{name}: {len(found)} sentences over {LONGEST_SENTENCE} words"
