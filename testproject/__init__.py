from __future__ import annotations

import importlib.util

# Load the Celery app with Django so that @shared_task binds to it; Celery is an optional
# extra, so without it the project runs without tasks.
if importlib.util.find_spec("celery") is not None:
    from testproject.celery import app as celery_app

    __all__ = ["celery_app"]
