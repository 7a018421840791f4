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


class NotLeaderOnce:
    """A consumer whose first watermark request meets a partition whose leader is moving."""

    def __init__(self) -> None:
        self.calls = 0

    def get_watermark_offsets(self, tp, timeout):
        from confluent_kafka import KafkaError, KafkaException

        self.calls += 1
        if self.calls == 1:
            raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
        return 0, 42


def test_a_leader_moving_while_a_partition_is_restored_is_waited_out() -> None:
    """The restore of a newly assigned partition asks its changelog's end: a NOT_LEADER_FOR_PARTITION there (a
    leader moving, a topic just created) stopped the processor with exit 2; it is asked again."""
    from confluent_kafka import TopicPartition

    from branch_settlement.processors.kafka.clients import high_watermark

    consumer = NotLeaderOnce()
    assert high_watermark(consumer, TopicPartition("ledger-changelog", 0), timeout_s=5) == 42
    assert consumer.calls == 2
