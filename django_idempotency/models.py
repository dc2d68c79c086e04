from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class IdempotencyRecord(models.Model):
    """One claimed key: who claimed it, what the request was, and the response to replay.

    On PostgreSQL the table is partitioned by ``created_at`` and its real primary key is
    ``(id, created_at)``; Django sees ``id`` alone so the admin can work with it.
    """

    class Status(models.IntegerChoices):
        IN_PROGRESS = 0, _("in progress")
        COMPLETED = 1, _("completed")

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
    created_at = models.DateTimeField(_("created at"))
    expires_at = models.DateTimeField(_("expires at"))

    class Meta:
        db_table = "django_idempotency_record"
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")
        indexes = [models.Index(fields=["key", "scope"], name="idempotency_key_scope")]

    def __str__(self) -> str:
        return f"{self.method} {self.path} [{self.key[:12]}]"
