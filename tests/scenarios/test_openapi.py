"""A bounded schema fuzz of the payments API (schemathesis): every answer is documented, in
its documented media type and shape, and none is a 5xx. Keys come from the key header's
pattern, so the fuzzer also holds the server to the pattern it publishes."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.factories import TokenFactory

pytest.importorskip("drf_spectacular")

from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# Per operation: about 400 requests in all, a few seconds.
EXAMPLES = 30
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture
def token(transactional_db: None, settings: Any) -> str:
    settings.PAYMENTS_FAULTS_ENABLED = False  # a fuzzed body could name a fault switch
    key: str = TokenFactory().key
    return key


def payments_api(token: str) -> Any:
    from testproject.wsgi import application

    return schemathesis.openapi.from_wsgi(
        "/api/schema/?format=json", application, headers={"Authorization": f"Token {token}"}
    ).exclude(path="/api/schema/")


def test_every_answer_is_documented(token: str) -> None:
    operations = [result.ok() for result in payments_api(token).get_all_operations()]
    assert len(operations) >= 10, "the payments API's schema lost its operations"
    # The in-process client does not inflate: a replay of a large body would come deflated.
    headers = {"Authorization": f"Token {token}", "Accept-Encoding": "identity"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def fuzz(case: Any) -> None:
            case.call_and_validate(headers=headers, checks=CHECKS)

        fuzz()
