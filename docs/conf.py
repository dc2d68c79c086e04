"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build/html``."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

project = "django-idempotency"
author = "django-idempotency developers"
copyright = "django-idempotency developers"
release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
version = release

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
# Stable anchors for "settings.md#idempotency-ttl-timedelta"-style links.
myst_heading_anchors = 3
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = f"django-idempotency {release}"
pygments_style = "friendly"
pygments_dark_style = "monokai"
