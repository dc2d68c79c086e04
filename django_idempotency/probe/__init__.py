"""The deployment probe: views an operator mounts, and the checks ``idempotency_probe`` drives
through the real front door (docs/deployment.md)."""
