"""What the processor says when the group's committed offsets never become available: the failure names the
likely cause (a hanging transaction on __consumer_offsets) and the tool that finds it. No broker is needed
for this: the consumer stands in for the one call, which keeps timing out."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from branch_settlement.processors.kafka import assignment as assignment_mod
from branch_settlement.processors.kafka import processor as processor_mod
from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.errors import KafkaFailure


class TimingOutConsumer:
    def __init__(self, error: KafkaError) -> None:
        self.error = error
        self.calls = 0

    def committed(self, partitions, timeout):
        self.calls += 1
        raise KafkaException(self.error)


def committed_with(monkeypatch, error: KafkaError) -> tuple[KafkaFailure, TimingOutConsumer]:
    monkeypatch.setattr(assignment_mod, "COMMITTED_EXTRA_WAIT_S", 0.0)
    config = ProcessorConfig(transaction_timeout_ms=1_000, topic_prefix="t.")
    proc = processor_mod.Processor(config, {"branch-events": "t.branch-events"})
    consumer = TimingOutConsumer(error)
    with pytest.raises(KafkaFailure) as failure:
        proc._committed(consumer, [TopicPartition("t.branch-events", 0)])
    return failure.value, consumer


def test_offsets_unavailable_past_the_transaction_timeout_point_at_a_hanging_transaction(monkeypatch) -> None:
    failure, consumer = committed_with(monkeypatch, KafkaError(KafkaError._TIMED_OUT, "Failed to get committed offsets"))
    assert consumer.calls >= 1  # retried until the budget (transaction timeout + extra wait) was spent
    message = str(failure)
    assert message.startswith("fetching the committed offsets: Failed to get committed offsets")
    assert "hanging transaction" in message and "__consumer_offsets" in message
    assert "kafka-transactions.sh find-hanging" in message
    assert failure.code == "_TIMED_OUT"


def test_a_non_retriable_error_is_reported_as_it_is(monkeypatch) -> None:
    failure, consumer = committed_with(monkeypatch, KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "denied"))
    assert consumer.calls == 1
    assert "hanging transaction" not in str(failure)
    assert failure.code == "GROUP_AUTHORIZATION_FAILED"
