from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class IdempotencyRecord(models.Model):
    """One claimed key: who claimed it, what the request was, and the response to replay.

    On PostgreSQL the table is partitioned by ``created_at`` and its real primary key is
    ``(id, created_at)``; Django sees ``id`` alone so the admin can work with it.
    """

    class Status(models.IntegerChoices):
        IN_PROGRESS = 0, _("in progress")
        COMPLETED = 1, _("completed")
        # A tombstone (``manage.py idempotency_erase``): no body, headers or principal, and a
        # retry of its key is refused (410) until the record would have expired.
        ERASED = 2, _("erased")

    # The method of an exactly-once consumer's record (a Celery task's message id is its key).
    CONSUMER_METHOD = "TASK"

    id = models.BigAutoField(primary_key=True)
    scope = models.CharField(_("principal"), max_length=255)
    key = models.CharField(_("key"), max_length=255)
    method = models.CharField(_("method"), max_length=16)
    path = models.TextField(_("path"))
    fingerprint = models.JSONField(_("request fingerprint"))
    status = models.SmallIntegerField(_("status"), choices=Status.choices, default=0)
    response_code = models.SmallIntegerField(_("response status"), null=True)
    response_headers = models.JSONField(_("response headers"), null=True)
    response_body = models.BinaryField(_("response body"), null=True)
    body_encoding = models.CharField(_("body encoding"), max_length=8, default="", blank=True)
    # The version its view declared (``response_version``); null: none, which is also what
    # the store function writes for a server still on the code before versions.
    response_version = models.CharField(  # noqa: DJ001
        _("response version"), max_length=64, null=True, blank=True
    )
    # One more than the key's previous execution (0: the first); on PostgreSQL each partition
    # has a unique index on (key, scope, generation), so a second execution of one key that
    # the lock failed to stop cannot commit (the migration makes the index per partition).
    generation = models.IntegerField(_("generation"), default=0, editable=False)
    created_at = models.DateTimeField(_("created at"))
    expires_at = models.DateTimeField(_("expires at"))

    class Meta:
        db_table = "django_idempotency_record"
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")
        indexes = [models.Index(fields=["key", "scope"], name="idempotency_key_scope")]
        # The admin shows stored bodies and headers only with it (superusers have it).
        permissions = [("view_stored_response", _("Can view stored response"))]

    def __str__(self) -> str:
        return f"{self.method} {self.path} [{self.key[:12]}]"


class OutboxMessage(models.Model):
    """A message (a Celery task call or an event) written in the transaction that sent it,
    published by the relay once that transaction has committed.

    On PostgreSQL the table is partitioned by ``created_at`` and its real primary key is
    ``(id, created_at)``; Django sees ``id`` alone, as for the records.
    """

    class Kind(models.IntegerChoices):
        TASK = 0, _("task")
        EVENT = 1, _("event")

    # The Celery task id, the same on every publish attempt: named by the request in a keyed
    # request or an exactly-once task (UUID version 8), else a random UUIDv7.
    id = models.UUIDField(_("message id"), primary_key=True)
    created_at = models.DateTimeField(_("created at"))
    kind = models.SmallIntegerField(_("kind"), choices=Kind.choices)
    name = models.CharField(_("task or topic"), max_length=255)
    args = models.JSONField(_("positional arguments"), default=list)
    kwargs = models.JSONField(_("keyword arguments"), default=dict)
    payload = models.JSONField(_("event payload"), null=True)
    options = models.JSONField(_("publish options"), default=dict)
    published_at = models.DateTimeField(_("published at"), null=True)
    attempts = models.IntegerField(_("failed attempts"), default=0)
    last_error = models.TextField(_("last error"), default="", blank=True)
    lease_owner = models.CharField(_("lease owner"), max_length=64, default="", blank=True)
    lease_until = models.DateTimeField(_("leased or held until"), null=True)
    fence = models.BigIntegerField(_("fence"), default=0)
    # When the relay looks for the exactly-once consumer's record of this published message,
    # and publishes it again if there is none (messaging/relay/redrive.py); null: nothing to check.
    redrive_at = models.DateTimeField(_("consumer record checked at"), null=True)
    # A database default too: the outbox writes its rows in SQL of its own (outbox.py).
    redrives = models.IntegerField(_("published again"), default=0, db_default=0)
    # Set when it failed IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS times: never tried again, never
    # dropped, until an operator requeues it (manage.py idempotency_outbox requeue).
    dead_at = models.DateTimeField(_("dead letter since"), null=True)
    # Messages with the same key are published one after the other, in the order of their
    # places, which follow commit order (messaging/outbox/__init__.py); null: no order kept.
    # Null rather than "": the claim and its partial index tell keyed rows by IS NOT NULL.
    ordering_key = models.CharField(_("ordering key"), max_length=255, null=True)  # noqa: DJ001
    ordering_seq = models.BigIntegerField(_("place in its key's order"), null=True)

    class Meta:
        db_table = "django_idempotency_outbox"
        # The relay's claim and the backlog check read only unpublished rows.
        indexes = [
            models.Index(
                fields=["created_at"],
                name="idempotency_outbox_pending",
                condition=models.Q(published_at__isnull=True),
            ),
            # The redrive reads only published rows whose consumer record is still unchecked.
            models.Index(
                fields=["redrive_at"],
                name="idempotency_outbox_redrive",
                condition=models.Q(redrive_at__isnull=False),
            ),
            # Dead letters only: counted and listed for operators.
            models.Index(
                fields=["dead_at"],
                name="idempotency_outbox_dead",
                condition=models.Q(dead_at__isnull=False),
            ),
            # The claim's lookup of an earlier unpublished message of the same key.
            models.Index(
                fields=["ordering_key", "ordering_seq"],
                name="idempotency_outbox_order",
                condition=models.Q(ordering_key__isnull=False, published_at__isnull=True),
            ),
        ]
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")

    def __str__(self) -> str:
        return f"{self.get_kind_display()} {self.name} [{self.id}]"


class OutboxEvent(models.Model):
    """An event for change data capture: written in the transaction that emits it, never
    updated, read from the write-ahead log by Debezium's outbox event router.

    The columns carry the names that router reads by default (``aggregatetype``,
    ``aggregateid``, ``type``, ``payload``). On PostgreSQL the table is partitioned by
    ``created_at`` and its real primary key is ``(id, created_at)``, as for the outbox.
    """

    # Made as the outbox's message ids are: Debezium puts it in the "id" header.
    id = models.UUIDField(_("event id"), primary_key=True)
    created_at = models.DateTimeField(_("created at"))
    # Debezium routes by it: the topic is outbox.event.<aggregate type> by default.
    aggregate_type = models.CharField(
        _("aggregate type"), max_length=255, db_column="aggregatetype"
    )
    # The Kafka message key: events of one aggregate stay in order on one partition.
    aggregate_id = models.CharField(_("aggregate id"), max_length=255, db_column="aggregateid")
    event_type = models.CharField(_("event type"), max_length=255, db_column="type")
    # Null: a tombstone for the aggregate's key, if the router is told to emit one.
    payload = models.JSONField(_("payload"), null=True)

    class Meta:
        db_table = "django_idempotency_outbox_event"
        verbose_name = _("outbox event (CDC)")
        verbose_name_plural = _("outbox events (CDC)")

    def __str__(self) -> str:
        return f"{self.aggregate_type} {self.aggregate_id} {self.event_type} [{self.id}]"


class RelayHeartbeat(models.Model):
    """A running relay's last sign of life: one row per relay, beaten every few seconds
    (``messaging/relay/heartbeats.py``), removed when the relay stops cleanly. A row that stops
    beating is a relay that died (its pid is gone) or hangs."""

    owner = models.CharField(_("relay"), max_length=64, primary_key=True)
    host = models.CharField(_("host"), max_length=255)
    pid = models.IntegerField(_("process id"))
    started_at = models.DateTimeField(_("started at"))
    beat_at = models.DateTimeField(_("last beat at"), db_index=True)
    published = models.BigIntegerField(_("messages published"), default=0)
    failed = models.BigIntegerField(_("failed publishes"), default=0)
    last_error = models.TextField(_("last error"), default="", blank=True)

    class Meta:
        db_table = "django_idempotency_relay_heartbeat"
        verbose_name = _("relay heartbeat")
        verbose_name_plural = _("relay heartbeats")

    def __str__(self) -> str:
        return f"relay {self.owner}"


class ProbeRow(models.Model):
    """A write of the deployment probe's (``django_idempotency.probe``): one per execution of
    a probe key, in the records' transaction; rows older than ``IDEMPOTENCY_MAX_TTL`` go."""

    key = models.CharField(_("key"), max_length=255, db_index=True)
    server = models.CharField(_("app server"), max_length=255)
    created_at = models.DateTimeField(_("created at"), default=timezone.now, db_index=True)

    class Meta:
        db_table = "django_idempotency_probe"
        verbose_name = _("probe write")
        verbose_name_plural = _("probe writes")

    def __str__(self) -> str:
        return f"probe {self.key} on {self.server}"


class StoredErrorCount(models.Model):
    """How many 4xx a principal stored in one minute, counted by every server process on the
    records' database (``engine/keeping.py``): past IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE
    a 4xx is answered but not stored. Rows of past minutes are deleted as the minutes pass."""

    scope = models.CharField(_("principal"), max_length=255)
    # Minutes since the epoch: one integer, whatever the database's time types.
    minute = models.BigIntegerField(_("minute"))
    stored = models.IntegerField(_("4xx stored"), default=0)

    class Meta:
        db_table = "django_idempotency_error_count"
        verbose_name = _("stored 4xx count")
        verbose_name_plural = _("stored 4xx counts")
        constraints = [
            models.UniqueConstraint(fields=["scope", "minute"], name="idempotency_error_count")
        ]

    def __str__(self) -> str:
        return f"{self.scope}: {self.stored} 4xx in minute {self.minute}"
