"""Fixtures for tests against a real Kafka broker (never a mock of one).

`kafka_bootstrap` finds a broker on SETTLE_BOOTSTRAP_SERVERS (default 127.0.0.1:9092) or starts the local one
with deploy/kafka.sh, and stops it at the end of the session only if it started it. When no broker can be had,
the tests that need one FAIL: a Kafka test that skips proves nothing.

`topic_prefix` gives each test its own topic names and deletes them afterwards; `kafka_topics` also
provisions the topics of deploy/topics.json under that prefix.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from branch_settlement.processors.kafka import topics
from branch_settlement.processors.kafka.connection import BOOTSTRAP_SERVERS_ENV, DEFAULT_BOOTSTRAP_SERVERS

REPO_DIR = Path(__file__).resolve().parents[2]
KAFKA_SH = REPO_DIR / "deploy" / "kafka.sh"
# A cold start installs Kafka from Maven Central first; kafka.sh has its own health timeout inside this.
KAFKA_UP_TIMEOUT_S = 600
PROBE_TIMEOUT_S = 5.0
# Tests create topics with 8 partitions; deleting them is quick, but the request must not hang a teardown.
ADMIN_TIMEOUT_S = 30.0


def broker_answers(bootstrap_servers: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
        return True
    except KafkaException:
        return False


def _local_port(bootstrap_servers: str) -> str | None:
    """The port, when the bootstrap address is a single broker on this machine that kafka.sh could run."""
    match = re.fullmatch(r"(?:127\.0\.0\.1|localhost):(\d+)", bootstrap_servers.strip())
    return match.group(1) if match else None


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    bootstrap_servers = os.environ.get(BOOTSTRAP_SERVERS_ENV) or DEFAULT_BOOTSTRAP_SERVERS
    if broker_answers(bootstrap_servers):
        yield bootstrap_servers
        return
    port = _local_port(bootstrap_servers)
    if port is None:
        pytest.fail(f"no Kafka broker answers on {bootstrap_servers} ({BOOTSTRAP_SERVERS_ENV}), and it is not "
                    "a local address deploy/kafka.sh could start one on", pytrace=False)
    env = {**os.environ, "KAFKA_PORT": port}
    up = subprocess.run(["bash", str(KAFKA_SH), "up"], env=env, capture_output=True, text=True,
                        timeout=KAFKA_UP_TIMEOUT_S)
    if up.returncode != 0 or not broker_answers(bootstrap_servers):
        pytest.fail(f"no Kafka broker on {bootstrap_servers}, and `deploy/kafka.sh up` could not start one:\n"
                    f"{up.stdout}{up.stderr}", pytrace=False)
    try:
        yield bootstrap_servers
    finally:
        subprocess.run(["bash", str(KAFKA_SH), "down"], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_bootstrap, "log_level": 0})


@pytest.fixture
def topic_prefix(request, kafka_admin: AdminClient) -> str:
    """A prefix no other test uses; every topic whose name starts with it is deleted after the test."""
    test_name = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name).strip("-")[:60]
    prefix = f"t.{test_name}.{uuid.uuid4().hex[:8]}."
    yield prefix
    leftovers = [name for name in kafka_admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics
                 if name.startswith(prefix)]
    topics.delete_topics(kafka_admin, leftovers, timeout_s=ADMIN_TIMEOUT_S)


@dataclass(frozen=True)
class KafkaTopics:
    bootstrap_servers: str
    prefix: str
    spec: topics.Spec

    def name(self, logical_name: str) -> str:
        """The physical name of a spec topic, e.g. name("branch-events")."""
        return self.spec.topic(logical_name).name


@pytest.fixture
def kafka_topics(kafka_bootstrap: str, kafka_admin: AdminClient, topic_prefix: str) -> KafkaTopics:
    """Every topic of deploy/topics.json, created under this test's own prefix."""
    spec = topics.load_spec(topics.DEFAULT_SPEC_PATH, prefix=topic_prefix)
    reports = topics.apply(kafka_admin, spec, timeout_s=ADMIN_TIMEOUT_S)
    assert not topics.has_drift(reports), reports
    return KafkaTopics(bootstrap_servers=kafka_bootstrap, prefix=topic_prefix, spec=spec)
