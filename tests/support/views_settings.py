"""The test settings serving ``tests.support.urls``: a live server of the test-only views."""

from __future__ import annotations

from tests.settings import *  # noqa: F403

ROOT_URLCONF = "tests.support.urls"
