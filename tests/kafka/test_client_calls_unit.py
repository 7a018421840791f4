"""How the processor calls its Kafka clients so that confluent-kafka's own failures never stop it.

Inside the group consumer's rebalance callbacks: they run inside the consumer's consume(); a call of the same
client that enters librdkafka with confluent-kafka's call state (list_topics, poll, consume, close) clears the
outer call's state when it returns, and the next callback consume() serves (a statistics report, a log line)
aborts the process (CallState_get: Assertion `cs != NULL'). So the input's partition count, asked on every
assignment, comes from the producer (decision 20). And the errors a call can meet that are not the
processor's to stop for: a leader moving, a transactional call failing inside confluent-kafka."""

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


def test_a_transactional_call_failing_inside_confluent_kafka_is_a_failed_call_not_a_crash() -> None:
    """A SystemError with no cause ('returned NULL without setting an exception', from flush under a
    coordinator kill) ended the processor with a traceback (exit 1); it is a failed call of the transaction,
    which the checkpoint aborts and retries like any KafkaException. One caused by a KafkaException (a fatal
    error raised in a delivery callback) is that KafkaException."""
    from confluent_kafka import KafkaError, KafkaException

    from branch_settlement.processors.kafka.txn_guard import bounded

    def null_without_exception():
        raise SystemError("<built-in method flush> returned NULL without setting an exception")

    with pytest.raises(KafkaException) as failed:
        bounded("flush", null_without_exception, timeout_s=5)
    assert failed.value.args[0].code() == KafkaError._FAIL and "flush failed inside confluent-kafka" in str(failed.value)

    fenced = KafkaException(KafkaError(KafkaError._FENCED))

    def caused():
        raise SystemError("callback") from fenced

    with pytest.raises(KafkaException) as raised:
        bounded("commit_transaction", caused, timeout_s=5)
    assert raised.value is fenced
