"""ASGI entry point: ``uvicorn testproject.asgi:application`` (add ``--workers N`` for more
processes). Sync views run in a thread of their own per request, async views on the loop;
database connections come from a bounded pool per process (``testproject.settings``)."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
# Read by the settings: under ASGI, database connections come from a bounded pool.
os.environ["DJANGO_ASGI"] = "1"

application = get_asgi_application()
