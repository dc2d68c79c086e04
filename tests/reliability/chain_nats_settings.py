"""Settings of the chain profile's processes for the ``nats`` destination: the chain's
(``tests/support/chain_settings.py``), with the charge's ledger message routed to NATS
JetStream (the private ``nats-server -js`` at ``$NATS_URL``, stream ``LEDGER``), where
``manage.py idempotency_consume_nats`` processes post it (``payments.handlers``)."""

from __future__ import annotations

import os

from tests.support.chain_settings import *  # noqa: F403

IDEMPOTENCY_OUTBOX_DESTINATIONS = {
    "default": {"BACKEND": "django_idempotency.messaging.destinations.celery.CeleryDestination"},
    "nats": {
        "BACKEND": "django_idempotency.messaging.destinations.nats.NatsDestination",
        "OPTIONS": {
            # One URL, or a cluster's, comma-separated.
            "servers": os.environ.get("NATS_URL", "nats://127.0.0.1:1").split(","),
            "stream": "LEDGER",  # tests/reliability/chain_destinations.py creates it
        },
    },
}
# The name of testproject.payments.tasks.post_ledger_entry (settings cannot import models).
IDEMPOTENCY_OUTBOX_ROUTES = {"task:payments.post_ledger_entry": "nats"}
