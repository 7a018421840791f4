"""The broker guarantees the processor's exactly-once design stands on (SPEC §11), checked on the real broker:
read_committed consumers see committed transactions only, and a second producer with the same
transactional.id fences the first."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

pytestmark = pytest.mark.kafka

PARTITION = 0
TIMEOUT_S = 30.0


def _producer(bootstrap_servers: str, transactional_id: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap_servers, "transactional.id": transactional_id,
                         "log_level": 0})
    producer.init_transactions(TIMEOUT_S)
    return producer


def _produce_in_transaction(producer: Producer, topic: str, values: list[str], commit: bool) -> None:
    producer.begin_transaction()
    for value in values:
        producer.produce(topic, value=value.encode(), key=b"parent-1", partition=PARTITION)
    if commit:
        producer.commit_transaction(TIMEOUT_S)
    else:
        # Abort purges what is still queued in the client; flush first so the aborted records are in the log
        # and it is the broker's transaction markers that hide them.
        assert producer.flush(TIMEOUT_S) == 0
        producer.abort_transaction(TIMEOUT_S)


def _read_partition(bootstrap_servers: str, topic: str, isolation_level: str) -> list[str]:
    """Every value of the partition visible at this isolation level, up to its end."""
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": f"probe-{uuid.uuid4().hex}",
                         "isolation.level": isolation_level, "enable.partition.eof": True,
                         "enable.auto.commit": False, "log_level": 0})
    consumer.assign([TopicPartition(topic, PARTITION, 0)])
    values = []
    try:
        while True:
            message = consumer.poll(TIMEOUT_S)
            assert message is not None, f"no end of partition within {TIMEOUT_S}s; read so far: {values}"
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    return values
                raise KafkaException(message.error())
            values.append(message.value().decode())
    finally:
        consumer.close()


def test_read_committed_sees_committed_records_and_never_aborted_ones(kafka_topics):
    topic = kafka_topics.name("branch-events")
    producer = _producer(kafka_topics.bootstrap_servers, f"{kafka_topics.prefix}txn")

    _produce_in_transaction(producer, topic, ["committed-1", "committed-2"], commit=True)
    _produce_in_transaction(producer, topic, ["aborted-1", "aborted-2"], commit=False)
    _produce_in_transaction(producer, topic, ["committed-3"], commit=True)

    assert _read_partition(kafka_topics.bootstrap_servers, topic, "read_committed") == [
        "committed-1", "committed-2", "committed-3"]
    # The aborted records were written: a read_uncommitted consumer sees them. Without this the first
    # assertion could pass because they never reached the log.
    assert _read_partition(kafka_topics.bootstrap_servers, topic, "read_uncommitted") == [
        "committed-1", "committed-2", "aborted-1", "aborted-2", "committed-3"]


def test_second_producer_with_same_transactional_id_fences_the_first(kafka_topics):
    topic = kafka_topics.name("branch-events")
    transactional_id = f"{kafka_topics.prefix}txn"
    old = _producer(kafka_topics.bootstrap_servers, transactional_id)
    old.begin_transaction()
    old.produce(topic, value=b"from-the-fenced-producer", key=b"parent-1", partition=PARTITION)
    old.flush(TIMEOUT_S)

    new = _producer(kafka_topics.bootstrap_servers, transactional_id)

    with pytest.raises(KafkaException) as raised:
        old.commit_transaction(TIMEOUT_S)
    error = raised.value.args[0]
    # librdkafka reports the broker's PRODUCER_FENCED as its own fatal _FENCED.
    assert error.fatal() and error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED), error
    # A fenced producer stays fenced: nothing it does later can reach the log.
    with pytest.raises(KafkaException):
        old.begin_transaction()

    _produce_in_transaction(new, topic, ["from-the-new-producer"], commit=True)
    assert _read_partition(kafka_topics.bootstrap_servers, topic, "read_committed") == ["from-the-new-producer"]
