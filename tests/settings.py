"""The test project's settings plus what only tests need."""

from __future__ import annotations

import hashlib

from testproject.settings import *  # noqa: F403
from testproject.settings import ALLOWED_HOSTS, BASE_DIR, DATABASES

ALLOWED_HOSTS = [*ALLOWED_HOSTS, "testserver"]

# Hashing passwords slowly proves nothing here.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

PAYMENTS_FAULTS_ENABLED = True

# One test database per checkout, so that runs from two clones (or two worktrees) sharing
# one DATABASE_URL server do not drop each other's database.
_checkout = hashlib.sha256(str(BASE_DIR).encode()).hexdigest()[:8]
DATABASES["default"]["TEST"] = {"NAME": f"test_idempotency_{_checkout}"}
