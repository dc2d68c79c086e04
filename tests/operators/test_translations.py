"""The admin and the system checks speak the project's language: every string they show is
marked for translation, the German catalogue translates each of them, and the compiled
catalogue is the one shipped. A check's id stays the same in every language: search by it."""

from __future__ import annotations

import ast
import gettext as gettext_module
import re
from pathlib import Path

import pytest
from django.test import override_settings
from django.utils import translation

from django_idempotency import checks
from django_idempotency.models import IdempotencyRecord, OutboxMessage

PACKAGE = Path(__file__).resolve().parents[2] / "django_idempotency"
LOCALE = PACKAGE / "locale"
LANGUAGES = sorted(p.name for p in LOCALE.iterdir() if p.is_dir())
# What a person reads: the admin, the models' names and choices, the app's name.
SOURCES = sorted([*(PACKAGE / "admin").glob("*.py"), PACKAGE / "models.py", PACKAGE / "apps.py"])
# What a developer reads: the system checks' messages and hints.
CHECK_SOURCES = sorted((PACKAGE / "checks").glob("*.py"))
TEMPLATES = sorted((PACKAGE / "templates").rglob("*.html"))

MARKERS = {"_", "gettext", "gettext_lazy", "ngettext", "ngettext_lazy", "pgettext"}
# The system check messages.
CHECK_MESSAGES = {"Critical", "Error", "Warning", "CheckWarning", "Info", "Debug"}
# Keyword arguments and class attributes whose value the admin shows.
SHOWN_KEYWORDS = {
    "description",
    "empty_value_display",
    "help_text",
    "label",
    "search_help_text",
    "short_description",
    "title",
    "verbose_name",
    "verbose_name_plural",
}


def marker(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in MARKERS:
            return name
    return None


def unmarked_words(node: ast.AST) -> list[str]:
    """Literal text (with a letter in it) in ``node`` that no marker call wraps."""
    if marker(node):
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if re.search(r"[A-Za-z]", node.value) else []
    if isinstance(node, ast.JoinedStr):
        return [ast.unparse(node)]
    if isinstance(node, ast.Dict):  # the parameters of a marked string: names, not text
        return [text for value in node.values for text in unmarked_words(value)]
    return [text for child in ast.iter_child_nodes(node) for text in unmarked_words(child)]


def shown_expressions(tree: ast.Module) -> list[ast.AST]:
    """Where a value reaches the admin's page: display keywords, class attributes, messages,
    a filter's choices and the fieldsets' titles."""
    shown: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            shown += [kw.value for kw in node.keywords if kw.arg in SHOWN_KEYWORDS]
            if getattr(node.func, "attr", None) == "message_user" and len(node.args) > 1:
                shown.append(node.args[1])
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.Assign | ast.AnnAssign) and statement.value:
                    if isinstance(statement, ast.Assign):
                        targets = statement.targets
                    else:
                        targets = [statement.target]
                    names = {t.id for t in targets if isinstance(t, ast.Name)}
                    if names & SHOWN_KEYWORDS:
                        shown.append(statement.value)
                    if "fieldsets" in names and isinstance(statement.value, ast.Tuple):
                        shown += [
                            t.elts[0] for t in statement.value.elts if isinstance(t, ast.Tuple)
                        ]
                if isinstance(statement, ast.FunctionDef) and statement.name == "lookups":
                    for ret in ast.walk(statement):
                        if isinstance(ret, ast.Return) and isinstance(ret.value, ast.List):
                            shown += [t.elts[1] for t in ret.value.elts if isinstance(t, ast.Tuple)]
    return shown


def check_expressions(tree: ast.Module) -> list[ast.AST]:
    """What a check says: its messages and hints (any call's ``hint=``, and a helper's tuple of
    what it found), the text a function of the checks returns, and what the local names in
    them were assigned."""
    shown: list[ast.AST] = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        assigned: dict[str, list[ast.AST]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and node.value:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, []).append(node.value)
        roots: list[ast.AST] = []
        returns = ast.unparse(function.returns) if function.returns else ""
        for node in ast.walk(function):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                if name in CHECK_MESSAGES:
                    roots += node.args[:1]
                    roots += [kw.value for kw in node.keywords if kw.arg == "msg"]
                roots += [kw.value for kw in node.keywords if kw.arg == "hint"]
                if name == "append" and node.args and isinstance(node.args[0], ast.Tuple):
                    roots.append(node.args[0])
            elif isinstance(node, ast.Return) and node.value and returns.startswith("str"):
                roots.append(node.value)
        seen: set[int] = set()
        while roots:
            root = roots.pop()
            if id(root) in seen:
                continue
            seen.add(id(root))
            shown.append(root)
            for name in (n for n in ast.walk(root) if isinstance(n, ast.Name)):
                roots += assigned.get(name.id, [])
    return shown


def unmarked_prose(node: ast.AST) -> list[str]:
    """Literal prose (letters and a space) in ``node`` that no marker call wraps. A check's
    text is full of names that read the same in every language (ids, settings, paths, SQL
    keywords passed as parameters), and none of them has a space."""
    if marker(node):
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if re.search(r"[A-Za-z]", node.value) and " " in node.value else []
    if isinstance(node, ast.JoinedStr):
        literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        return [ast.unparse(node)] if re.search(r"[A-Za-z]", literal) and " " in literal else []
    if isinstance(node, ast.Dict):  # the parameters of a marked string, not their names
        return [text for value in node.values for text in unmarked_prose(value)]
    return [text for child in ast.iter_child_nodes(node) for text in unmarked_prose(child)]


def marked_strings() -> set[str]:
    """Every msgid the sources and templates mark, as makemessages extracts them."""
    found: set[str] = set()
    for source in [*SOURCES, *CHECK_SOURCES]:
        for node in ast.walk(ast.parse(source.read_text())):
            if marker(node) and isinstance(node, ast.Call) and node.args:
                first = node.args[1 if marker(node) == "pgettext" else 0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.add(first.value)
    for template in TEMPLATES:
        text = template.read_text()
        found |= set(re.findall(r"{% translate '([^']+)' %}", text))
        blocks = re.findall(r"{% blocktranslate[^%]*%}(.*?){% endblocktranslate %}", text)
        found |= {re.sub(r"{{ (\w+) }}", r"%(\1)s", block) for block in blocks}
    return found


def catalogue(language: str) -> dict[str, list[str]]:
    """msgid to its msgstr (or msgstr[0], msgstr[1]) in ``language``'s django.po."""
    text = (LOCALE / language / "LC_MESSAGES" / "django.po").read_text()
    entries: dict[str, list[str]] = {}
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        current = ""
        for line in block.splitlines():
            if line.startswith("#"):
                continue
            match = re.match(r"^(msgid_plural|msgid|msgstr(?:\[\d\])?) (\".*\")$", line)
            if match:
                current = match[1]
                fields[current] = ast.literal_eval(match[2])
            elif line.startswith('"'):
                fields[current] += ast.literal_eval(line)
        if fields.get("msgid"):
            entries[fields["msgid"]] = [v for k, v in sorted(fields.items()) if "msgstr" in k]
    return entries


def test_a_language_beside_english_is_shipped() -> None:
    assert "de" in LANGUAGES


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_string_the_admin_shows_is_marked_for_translation(source: Path) -> None:
    tree = ast.parse(source.read_text())
    unmarked = [text for node in shown_expressions(tree) for text in unmarked_words(node)]
    assert unmarked == []


def test_the_scan_finds_an_unmarked_string() -> None:
    # Guards the test above against finding nothing whatever the sources say.
    tree = ast.parse(
        "class F:\n    title = 'state'\n"
        "    def lookups(self, r, m):\n        return [('a', 'Pending'), ('b', _('Done'))]\n"
        "@admin.display(description=_('ok'))\ndef f(): self.message_user(r, f'{n} done')\n"
    )
    found = [text for node in shown_expressions(tree) for text in unmarked_words(node)]
    assert found == ["state", "Pending", "f'{n} done'"]


@pytest.mark.parametrize("source", CHECK_SOURCES, ids=lambda p: p.name)
def test_every_string_a_check_says_is_marked_for_translation(source: Path) -> None:
    tree = ast.parse(source.read_text())
    unmarked = [text for node in check_expressions(tree) for text in unmarked_prose(node)]
    assert unmarked == []


def test_the_scan_finds_an_unmarked_check_string() -> None:
    # Guards the test above: a message, a hint, a fragment assigned to a name and the text a
    # helper returns are all found; ids, and parameters of a marked string, are not text.
    tree = ast.parse(
        "def check(a):\n"
        "    why = 'no relay'\n"
        "    return [Error(_('%(a)s: %(why)s') % {'a': a, 'why': why}, hint=f'Run {a}',\n"
        "                  id='django_idempotency.E999'),\n"
        "            CheckWarning('Too late', hint=_('Run it'), id='django_idempotency.W999')]\n"
        "def said(a) -> str:\n"
        "    return 'is not callable' if as_written('TTL') else _('ok')\n"
    )
    found = [text for node in check_expressions(tree) for text in unmarked_prose(node)]
    assert sorted(found) == ["Too late", "f'Run {a}'", "is not callable", "no relay"]


@pytest.mark.parametrize("language", LANGUAGES)
def test_the_catalogue_translates_every_marked_string_and_no_other(language: str) -> None:
    entries = catalogue(language)
    marked = marked_strings()
    assert len(marked) > 100, "the scan found too few marked strings"
    assert set(entries) == marked
    assert [msgid for msgid, strs in entries.items() if not all(strs)] == []


@pytest.mark.parametrize("language", LANGUAGES)
def test_the_compiled_catalogue_is_the_po_file_compiled(language: str) -> None:
    messages = LOCALE / language / "LC_MESSAGES"
    with (messages / "django.mo").open("rb") as compiled:
        mo = gettext_module.GNUTranslations(compiled)
    for msgid, strs in catalogue(language).items():
        if len(strs) == 1:
            assert mo.gettext(msgid) == strs[0], msgid
        else:
            # n=1 and n=2 take msgstr[0] and msgstr[1] in every language shipped so far.
            assert [mo.ngettext(msgid, msgid + "s", n) for n in (1, 2)] == strs, msgid


def test_the_admin_reads_german_where_the_project_asks_for_it() -> None:
    with translation.override("de"):
        assert str(IdempotencyRecord._meta.verbose_name_plural) == "Idempotenz-Einträge"
        assert str(OutboxMessage._meta.verbose_name) == "Outbox-Nachricht"
        many = translation.ngettext("Erased %(count)d record.", "Erased %(count)d records.", 3)
        assert many % {"count": 3} == "3 Einträge gelöscht."
    assert str(IdempotencyRecord._meta.verbose_name_plural) == "idempotency records"


@override_settings(IDEMPOTENCY_HEADER="Idempotency_Key", IDEMPOTENCY_REQUIRD=True)
def test_a_check_reads_german_where_the_project_asks_for_it() -> None:
    with translation.override("de"):
        header, unknown = checks.check_settings(None)
    assert header.id == "django_idempotency.E002"
    assert header.msg == "IDEMPOTENCY_HEADER 'Idempotency_Key' ist kein HTTP-Headername."
    assert header.hint.startswith("Verwenden Sie Buchstaben, Ziffern und Bindestriche")
    assert unknown.id == "django_idempotency.W020"
    assert unknown.msg == (
        "IDEMPOTENCY_REQUIRD ist keine Einstellung von django-idempotency und hat deshalb "
        "keine Wirkung. Meinten Sie IDEMPOTENCY_REQUIRED?"
    )
    # Outside the override, the same check says it in English.
    assert checks.check_settings(None)[0].msg.endswith("is not an HTTP header name.")
