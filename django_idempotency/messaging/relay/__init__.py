"""The relay: ``loop`` claims committed outbox rows (``outbox.leases``), hands them to the
destinations and marks what they published; ``heartbeats`` say which relays run, and
``redrive`` publishes again what a consumer has no record of."""
