"""ASGI entry point: ``uvicorn testproject.asgi:application`` (add ``--workers N`` for more
processes). Sync views run in a thread of their own per request, async views on the loop."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

application = get_asgi_application()
