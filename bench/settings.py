"""The testproject's settings with the benchmark's floor views (``bench/floor_views.py``) beside
its URLs: what the request benchmark's gunicorn serves."""

from __future__ import annotations

from testproject.settings import *  # noqa: F403

ROOT_URLCONF = "bench.floor_views"
