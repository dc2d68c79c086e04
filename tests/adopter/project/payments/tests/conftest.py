import uuid

import pytest
from rest_framework.test import APIClient

from payments.models import ApiClient


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice")


@pytest.fixture
def api(alice):
    client = APIClient()
    client.force_authenticate(alice)
    return client


@pytest.fixture
def partner():
    return ApiClient.objects.create(name="acme", key=f"acme-{uuid.uuid4().hex}")
