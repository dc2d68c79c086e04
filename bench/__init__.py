"""Benchmarks of django-idempotency against its baselines; run ``python -m bench``."""
