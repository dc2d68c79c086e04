"""System checks: ``django_idempotency.E0xx`` for settings, ``W0xx`` for the environment."""

from __future__ import annotations
