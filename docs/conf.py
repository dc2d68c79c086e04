"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build/html``."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import django
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent

# The API reference imports the package: Django must be set up, with settings of our own
# (a project's settings could start a database).
sys.path.insert(0, str(ROOT))
os.environ.pop("DJANGO_SETTINGS_MODULE", None)
settings.configure(
    INSTALLED_APPS=[
        "django.contrib.contenttypes",
        "django.contrib.auth",
        "rest_framework",
        "django_idempotency",
    ],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True,
)
django.setup()

project = "django-idempotency"
author = "django-idempotency developers"
copyright = "django-idempotency developers"
release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc"]
autodoc_member_order = "bysource"
# The extras' libraries: the reference documents their glue without installing them (Read the
# Docs installs the drf and ninja extras only). Django's Tasks framework on Django 5.2 is the
# backport's.
autodoc_mock_imports = ["celery", "kombu", "nats", "django_tasks"]
# Signatures stay readable; the types are listed under each description.
autodoc_typehints = "description"
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
# Stable anchors for "settings.md#idempotency-ttl-timedelta"-style links.
myst_heading_anchors = 3
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = f"django-idempotency {release}"
pygments_style = "friendly"
pygments_dark_style = "monokai"
