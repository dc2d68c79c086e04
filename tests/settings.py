"""The test project's settings plus what only tests need."""

from __future__ import annotations

import os

from testproject.settings import *  # noqa: F403
from testproject.settings import ALLOWED_HOSTS, DATABASES

ALLOWED_HOSTS = [*ALLOWED_HOSTS, "testserver"]

# Hashing passwords slowly proves nothing here.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

PAYMENTS_FAULTS_ENABLED = True

# One test database per test session: sessions sharing a server (two clones, or several
# people in one checkout) never drop each other's database. Child processes are given the
# name in DATABASE_URL, so this only matters to the session that creates it.
DATABASES["default"]["TEST"] = {"NAME": f"test_idempotency_{os.getpid()}"}
