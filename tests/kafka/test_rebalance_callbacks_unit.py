"""What the processor may call inside its group consumer's rebalance callbacks. They run inside the consumer's
consume(); a call of the same client that enters librdkafka with confluent-kafka's call state (list_topics,
poll, consume, close) clears the outer call's state when it returns, and the next callback consume() serves
(a statistics report, a log line) aborts the process (CallState_get: Assertion `cs != NULL'). So the input's
partition count, asked on every assignment, comes from the producer (decision 20)."""

from __future__ import annotations

import pytest

from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.processor import Processor

pytestmark = pytest.mark.unit


class Metadata:
    def __init__(self, partitions: int) -> None:
        self.topics = {"branch-events": type("T", (), {"error": None, "partitions": dict.fromkeys(range(partitions))})()}


class Producer:
    def __init__(self) -> None:
        self.asked = 0

    def list_topics(self, topic, timeout):
        self.asked += 1
        return Metadata(8)


class GroupConsumer:
    """Any call of it from the callback is the bug."""

    def __getattr__(self, name):
        raise AssertionError(f"the group consumer's {name} was called inside its rebalance callback")


def test_the_partition_count_is_asked_of_the_producer_not_the_group_consumer() -> None:
    processor = Processor(ProcessorConfig(), {"branch-events": "branch-events"})
    processor.producer = Producer()
    assert processor._partition_count(GroupConsumer()) == 8
    assert processor.producer.asked == 1
