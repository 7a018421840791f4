"""The fault suite's reduced set. Kafka-backed tests here FAIL (never skip) when no broker answers:
`make test` starts the shared local broker first (`make kafka-up`)."""

from __future__ import annotations

import os

import pytest

from faults.kafka_io import broker_answers


@pytest.fixture(scope="session")
def shared_bootstrap() -> str:
    bootstrap = os.environ.get("SETTLE_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    if not broker_answers(bootstrap):
        pytest.fail(f"no Kafka broker answers on {bootstrap}: run `make kafka-up` (or set SETTLE_BOOTSTRAP_SERVERS)",
                    pytrace=False)
    return bootstrap
