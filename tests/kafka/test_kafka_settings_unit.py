"""Topic spec and connection settings without a broker."""

from __future__ import annotations

import argparse
import json

import pytest

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka import topics
from branch_settlement.processors.kafka.connection import add_connection_arguments, config_from_args
from branch_settlement.processors.kafka.errors import TopicSpecError

pytestmark = pytest.mark.unit

SPEC = json.loads(topics.DEFAULT_SPEC_PATH.read_text())


def test_spec_has_the_topics_of_spec_sections_10_and_11():
    spec = topics.load_spec()
    assert set(spec.names()) == {"branch-events", "ledger-changelog", "ledger-ticks", "capacity-releases",
                                 "settlement-results", "settlement-audit", "branch-events-dlq"}
    assert spec.topic("branch-events").config["retention.ms"] == "-1"
    assert spec.topic("branch-events").config["cleanup.policy"] == "delete"
    assert spec.topic("ledger-changelog").config["cleanup.policy"] == "compact"
    # Co-partitioning: partition p of the input, the changelog and the keyed outputs belong together.
    assert {topic.partitions for topic in spec.topics} == {SPEC["default_partitions"]}


def test_prefix_and_partitions_override_apply_to_every_topic():
    spec = topics.load_spec(prefix="staging.", partitions=3)
    assert spec.names()["settlement-audit"] == "staging.settlement-audit"
    assert {topic.partitions for topic in spec.topics} == {3}


@pytest.mark.parametrize("document, message", [
    ({"topics": []}, "default_partitions"),
    ({"default_partitions": 8, "topics": [{"name": "a", "config": {"retention.ms": -1}}]}, "strings"),
    ({"default_partitions": 8, "topics": [{"name": "a"}, {"name": "a"}]}, "twice"),
    ({"default_partitions": 8, "topics": [{"name": "a b"}]}, "not a valid Kafka topic name"),
])
def test_invalid_spec_is_refused_with_the_reason(document, message):
    with pytest.raises(TopicSpecError, match=message):
        topics.parse_spec(document)


def test_missing_spec_file_names_the_path(tmp_path):
    with pytest.raises(TopicSpecError, match="no topic spec at .*nope.json"):
        topics.load_spec(tmp_path / "nope.json")


def _connection_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace, environ: dict) -> dict:
    """config_from_args without its `logger` (where librdkafka's own lines go)."""
    config = config_from_args(args, environ=environ)
    assert config.pop("logger").name == "settle.librdkafka"
    return config


def test_connection_settings_precedence_default_env_flag():
    assert _settings(_connection_args(), environ={}) == {"bootstrap.servers": "127.0.0.1:9092"}
    environ = {"SETTLE_BOOTSTRAP_SERVERS": "kafka-1:9093,kafka-2:9093",
               "SETTLE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "SETTLE_KAFKA_SASL_MECHANISM": "PLAIN"}
    assert _settings(_connection_args(), environ=environ) == {
        "bootstrap.servers": "kafka-1:9093,kafka-2:9093", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN"}
    flags = _connection_args("--bootstrap-servers", "kafka-3:9093", "--kafka-config", "sasl.mechanism=SCRAM-SHA-512",
                             "--kafka-config", "ssl.ca.location=/etc/ca=1.pem")
    assert _settings(flags, environ=environ) == {
        "bootstrap.servers": "kafka-3:9093", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512", "ssl.ca.location": "/etc/ca=1.pem"}


@pytest.mark.parametrize("argv, environ", [
    (["--kafka-config", "no-equals-sign"], {}),
    (["--kafka-config", "bootstrap.servers=elsewhere:9092"], {}),
    ([], {"SETTLE_KAFKA_BOOTSTRAP_SERVERS": "elsewhere:9092"}),
])
def test_bad_or_competing_connection_settings_are_refused(argv, environ):
    with pytest.raises(ConfigError):
        config_from_args(_connection_args(*argv), environ=environ)


def test_the_transactional_producer_retries_soon_a_user_may_retune_it_never_weaken_it():
    """retry.backoff.ms 10 by default (decision 31: a CONCURRENT_TRANSACTIONS answer to AddOffsetsToTxn cost
    ~100 ms at librdkafka's default); a user's librdkafka settings change the tuning, never idempotence or acks."""
    from branch_settlement.processors.kafka.config import ProcessorConfig
    from branch_settlement.processors.kafka.processor_clients import producer_settings

    plain = producer_settings(ProcessorConfig())
    assert plain["retry.backoff.ms"] == 10 and plain["linger.ms"] == 5 and plain["compression.type"] == "lz4"
    assert plain["enable.idempotence"] is True and plain["acks"] == "all"
    assert plain["transactional.id"] == ProcessorConfig().transactional_id

    user = producer_settings(ProcessorConfig(kafka={"retry.backoff.ms": "50", "linger.ms": "20", "acks": "1",
                                                    "enable.idempotence": "false"}))
    assert user["retry.backoff.ms"] == "50" and user["linger.ms"] == "20"
    assert user["enable.idempotence"] is True and user["acks"] == "all"
