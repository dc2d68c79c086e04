"""Signals. The library connects no receivers of its own (but telemetry's, from ready()); they
are sent with send_robust, so a failing receiver never fails a request."""

from __future__ import annotations

from django.dispatch import Signal

# Sent by the engine after a stored response was replayed, outside the transaction.
# kwargs: request (HttpRequest), key (str), principal (str), status (int).
response_replayed = Signal()

# Sent by the engine when a key came back with a different request, before the 422.
# kwargs: request, key, principal, differing (list[str]: "method", "path", "query", "body",
# "header:<name>").
key_reused = Signal()

# Sent by the engine when a duplicate waited for the in-flight request and gave up (409).
# kwargs: request, key, principal, waited (float, seconds).
request_conflicted = Signal()

# Sent by the engine after the first execution's response was stored and committed, outside
# the transaction (under ATOMIC_REQUESTS: after the savepoint, before the request commits).
# kwargs: request, key, principal, status (int).
response_stored = Signal()

# Sent by partition maintenance after creating / dropping partitions, outside any transaction.
# kwargs: names (list[str]), using (str: the database alias).
partitions_created = Signal()
partitions_dropped = Signal()

# Sent by the outbox relay after it marked messages published, outside any transaction.
# kwargs: ids (list[str]: the message ids, which are the Celery task ids), enqueued
# (list[datetime]: when each was enqueued, in the same order), using (str: the database alias).
outbox_published = Signal()

# Sent by the outbox relay after its redrive put published messages back to be published
# again (no exactly-once consumer had recorded them), outside any transaction.
# kwargs: ids (list[str]: the message ids), using (str: the database alias).
outbox_redriven = Signal()

# Sent by erasure (``manage.py idempotency_erase``, the records admin's action) after a
# principal's records became tombstones, outside any transaction (each batch committed).
# kwargs: principal (str: as stored), count (int: records erased by this run), using (str).
records_erased = Signal()

# Sent by the engine when a principal's 4xx went past IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE
# in this process (once a minute per principal), inside the request's transaction, which then
# rolls back. kwargs: principal (str), limit (int), view (str: the view's dotted name).
stored_errors_limited = Signal()
