"""The testproject's URLs, and the suite's own misordered view (``views.py``): served only
by the deployment shapes' servers (``shapes_settings.py``), never by the payments API."""

from __future__ import annotations

from django.urls import path

from testproject.urls import urlpatterns as project
from tests.reliability.profiles import MISORDERED_PATH
from tests.reliability.views import charge_misordered

urlpatterns = [*project, path(MISORDERED_PATH.lstrip("/"), charge_misordered)]
