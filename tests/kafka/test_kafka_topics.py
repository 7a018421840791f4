"""`settle topics apply|describe` against the real broker: topics come out as deploy/topics.json says (read
back independently of the code under test), a second apply changes nothing, and drift is reported, not fixed."""

from __future__ import annotations

import json
import socket

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from branch_settlement.processors.cli.main import main as settle
from branch_settlement.processors.kafka import topics
from branch_settlement.processors.cli.topics import EXIT_DRIFT, EXIT_OK, EXIT_UNAVAILABLE

pytestmark = pytest.mark.kafka

SPEC = json.loads(topics.DEFAULT_SPEC_PATH.read_text())
TIMEOUT_S = 30.0


def settle_topics(*argv: str) -> int:
    """`settle topics ...`, through the real command line."""
    return settle(["topics", *argv])


def read_back(admin: AdminClient, name: str) -> tuple[int, dict[str, str]]:
    """Partition count and config of a topic, straight from the broker."""
    metadata = admin.list_topics(topic=name, timeout=TIMEOUT_S).topics[name]
    assert metadata.error is None, metadata.error
    (config_future,) = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name)]).values()
    config = {key: entry.value for key, entry in config_future.result().items()}
    return len(metadata.partitions), config


def create_topic(admin: AdminClient, name: str, partitions: int, config: dict[str, str]) -> None:
    (future,) = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1,
                                              config=config)]).values()
    future.result()


def test_apply_creates_every_topic_as_the_spec_says(kafka_bootstrap, kafka_admin, topic_prefix, capsys):
    assert settle_topics("apply", "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", topic_prefix) == EXIT_OK

    for entry in SPEC["topics"]:
        partitions, config = read_back(kafka_admin, topic_prefix + entry["name"])
        assert partitions == entry.get("partitions", SPEC["default_partitions"]), entry["name"]
        for key, value in entry["config"].items():
            assert config[key] == value, (entry["name"], key)
    assert f"{len(SPEC['topics'])} created" in capsys.readouterr().out


def test_second_apply_creates_nothing_and_reports_all_ok(kafka_bootstrap, topic_prefix, capsys):
    args = ("apply", "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", topic_prefix)
    assert settle_topics(*args) == EXIT_OK
    capsys.readouterr()

    assert settle_topics(*args) == EXIT_OK
    count = len(SPEC["topics"])
    assert capsys.readouterr().out.strip() == f"{count} topics: {count} ok"


def test_wrong_partition_count_is_reported_and_left_alone(kafka_bootstrap, kafka_admin, topic_prefix, capsys):
    drifted = topic_prefix + "branch-events"
    create_topic(kafka_admin, drifted, partitions=3, config={"retention.ms": "-1"})

    assert settle_topics("apply", "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", topic_prefix,
                         "--json") == EXIT_DRIFT

    report = {item["topic"]: item for item in json.loads(capsys.readouterr().out)}
    assert report[drifted]["status"] == "drift"
    assert report[drifted]["partitions_observed"] == 3
    assert any(problem.startswith("partitions: 3 on the cluster, 8 in the spec")
               for problem in report[drifted]["problems"])
    assert {item["status"] for name, item in report.items() if name != drifted} == {"created"}
    assert read_back(kafka_admin, drifted)[0] == 3


def test_wrong_cleanup_policy_is_reported_and_left_alone(kafka_bootstrap, kafka_admin, topic_prefix, capsys):
    drifted = topic_prefix + "ledger-changelog"
    create_topic(kafka_admin, drifted, partitions=SPEC["default_partitions"], config={"cleanup.policy": "delete"})

    assert settle_topics("apply", "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", topic_prefix) == EXIT_DRIFT

    out = capsys.readouterr().out
    assert f"drift    {drifted}" in out
    assert "cleanup.policy: 'delete' on the cluster, 'compact' in the spec" in out
    assert read_back(kafka_admin, drifted)[1]["cleanup.policy"] == "delete"


def test_describe_reports_missing_topics_and_creates_none(kafka_bootstrap, kafka_admin, topic_prefix, capsys):
    exit_code = settle_topics("describe", "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", topic_prefix)

    assert exit_code == EXIT_DRIFT
    assert capsys.readouterr().out.count("missing ") == len(SPEC["topics"])
    assert not [name for name in kafka_admin.list_topics(timeout=TIMEOUT_S).topics if name.startswith(topic_prefix)]


def test_unreachable_cluster_exits_2_with_one_clear_message(capsys):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    # Nothing listens on `port` once the socket is closed.
    exit_code = settle_topics("apply", "--bootstrap-servers", f"127.0.0.1:{port}", "--timeout-ms", "2000")

    assert exit_code == EXIT_UNAVAILABLE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no metadata from the Kafka cluster" in captured.err and f"127.0.0.1:{port}" in captured.err
    assert "Traceback" not in captured.err
