"""factory-boy factories for the core tests: users, tokens, records (a view's, a consumer's),
request scripts, keys."""

from __future__ import annotations

import uuid
from datetime import timedelta

import factory
from django.utils import timezone
from factory.django import DjangoModelFactory

from django_idempotency.models import IdempotencyRecord


class UserFactory(DjangoModelFactory):
    class Meta:
        model = "auth.User"

    username = factory.Sequence(lambda n: f"core-user-{n}")


class TokenFactory(DjangoModelFactory):
    """A DRF token; ``TokenFactory().key`` goes in ``Authorization: Token <key>``."""

    class Meta:
        model = "authtoken.Token"

    user = factory.SubFactory(UserFactory)


class IdempotencyRecordFactory(DjangoModelFactory):
    """A completed record, as the engine writes it (for retention and admin-style tests)."""

    class Meta:
        model = IdempotencyRecord

    scope = "anonymous"
    key = factory.Faker("uuid4")
    method = "POST"
    path = "/drf/"
    fingerprint = factory.Dict({})
    status = IdempotencyRecord.Status.COMPLETED
    response_code = 201
    response_headers = factory.List([factory.List(["Content-Type", "application/json"])])
    response_body = b'{"stored": true}'
    created_at = factory.LazyFunction(timezone.now)
    expires_at = factory.LazyAttribute(lambda record: record.created_at + timedelta(hours=24))


class ConsumerRecordFactory(IdempotencyRecordFactory):
    """The record an exactly-once consumer keeps of a message it ran: under the consumer's
    principal, keyed by the message id (``messaging.consumers.run_exactly_once``)."""

    class Params:
        task = "tests.consumer"

    scope = factory.LazyAttribute(lambda record: f"consumer:{record.task}")
    key = factory.LazyFunction(lambda: str(uuid.uuid4()))
    method = "TASK"
    path = factory.SelfAttribute("task")
    response_code = 200
    response_headers = factory.List([factory.List(["content-type", "application/json"])])
    response_body = b"null"
    expires_at = factory.LazyAttribute(lambda record: record.created_at + timedelta(days=7))


class ScriptFactory(factory.DictFactory):
    """A request body for ``tests.support.views``; each gets its own tag, so counts never mix."""

    tag = factory.LazyFunction(lambda: uuid.uuid4().hex)


def new_key() -> str:
    return str(uuid.uuid4())
