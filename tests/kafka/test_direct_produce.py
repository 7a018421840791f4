"""Records handed to librdkafka directly (native/src/produce.rs, processors/kafka/direct_produce.py): where the path is
taken, that it queues exactly what `Producer.produce` queues (the same records, in the same order, tombstones and
empty keys included, on a real broker), and that a record librdkafka refuses, or a full queue, is handled as the
`produce` path handles it."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from branch_settlement.processors.crosscheck.readers import read_committed
from branch_settlement.processors.kafka import checkpoint, direct_produce
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import default_codec

needs_compiled = pytest.mark.skipif(native.module() is None, reason="needs the compiled module")
TIMEOUT_S = 30.0


def unconnected(**config) -> Producer:
    return Producer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0, **config})


class SubclassedProducer(Producer):
    pass


@pytest.mark.unit
def test_the_librdkafka_path_is_read_from_the_mapped_libraries(tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f10-7f20 r--p 00000000 00:00 0 \n"
        "7f20-7f30 r-xp 00000000 08:01 2 /opt/some dir/confluent_kafka.libs/librdkafka-0cb94173.so.1\n")
    assert direct_produce.librdkafka_path(str(maps)) == "/opt/some dir/confluent_kafka.libs/librdkafka-0cb94173.so.1"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert direct_produce.librdkafka_path(str(maps)) is None
    assert direct_produce.librdkafka_path(str(tmp_path / "absent")) is None


@pytest.mark.unit
@needs_compiled
def test_the_direct_path_is_taken_only_for_confluent_kafkas_own_producer_in_the_compiled_implementation(
        monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, native.COMPILED)
    assert direct_produce.librdkafka_path() is not None  # this process has confluent-kafka's librdkafka mapped
    assert direct_produce.direct(unconnected())
    assert not direct_produce.direct(SubclassedProducer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0}))
    monkeypatch.setenv(native.ENV, native.PYTHON)
    assert not direct_produce.direct(unconnected())


def _records(count: int, size: int = 20) -> list[tuple]:
    """(logical topic, key, value): some without a key, every topic of a partition's outputs."""
    topics = ("settlement-results", "capacity-releases", "settlement-audit", "ledger-ticks")
    return [(topics[n % 4], None if n % 5 == 0 else b"key-%d" % n, bytes([n % 256]) * size) for n in range(count)]


@pytest.mark.unit
@needs_compiled
@pytest.mark.parametrize("direct", [True, False])
def test_a_record_librdkafka_refuses_directly_is_refused_by_produce_with_the_same_words(direct, monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, native.COMPILED)
    producer = unconnected(**{"message.max.bytes": 2_000})
    assert direct_produce.direct(producer)
    produce_records = native.compiled_function("produce_records")
    topics = {"settlement-results": "t.r", "capacity-releases": "t.c", "settlement-audit": "t.a", "ledger-ticks": "t.t"}
    records = _records(6) + [("settlement-audit", b"big", b"x" * 5_000)] + _records(3)
    before = native.module().direct_produce_count()
    failed = produce_records(producer, records, 3, [len(records) - 1], lambda err, msg: None, topics=topics,
                             direct=direct)
    assert failed is not None
    index, error = failed
    assert index == 6
    assert isinstance(error, KafkaException) and error.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE
    assert "Unable to produce message" in str(error)  # raised by `produce`, as without the direct path
    # the six before it went to librdkafka directly on the direct path, none otherwise
    assert native.module().direct_produce_count() - before == (6 if direct else 0)


@pytest.mark.unit
@needs_compiled
def test_a_full_queue_is_polled_and_the_same_record_handed_over_again(monkeypatch) -> None:
    """With room for four records and records that expire after 50 ms on a producer that never connects, the loop
    meets a full queue again and again; each time it polls (which drops what expired) and goes on with the record
    it could not queue: it returns once every record was handed over, and the last one's delivery report (kept
    for the reported record, through `produce`) is for that record."""
    monkeypatch.setenv(native.ENV, native.COMPILED)
    producer = unconnected(**{"queue.buffering.max.messages": 4, "message.timeout.ms": 50})
    reports = []
    records = [(b"k%d" % n, b"v%d" % n) for n in range(12)]
    failed = native.compiled_function("produce_records")(
        producer, records, 0, [11], lambda err, msg: reports.append((err.code(), msg.key())), topic="t.changelog",
        direct=direct_produce.direct(producer))
    assert failed is None
    deadline = 100
    while not reports and deadline:
        producer.poll(0.1)
        deadline -= 1
    assert reports == [(KafkaError._MSG_TIMED_OUT, b"k11")]


def _read(bootstrap_servers: str, topic: str, partition: int) -> list[tuple]:
    """The partition's committed records, (key, value, offset): read again until its last record is readable (the
    commit returns before the broker has written every partition's transaction marker)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        records = read_committed({"bootstrap.servers": bootstrap_servers, "log_level": 0}, topic, [partition])
        read = [(key, value, offset) for offset, key, value in records[partition]]
        ends = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "probe", "log_level": 0})
        try:
            high = ends.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[1]
        finally:
            ends.close()
        # the last offset is the commit marker's: the last record is just before it
        if (read and read[-1][2] == high - 2) or time.monotonic() > deadline:
            return read
        time.sleep(0.1)


@pytest.mark.kafka
@needs_compiled
def test_records_produced_directly_are_the_records_produce_makes_in_a_committed_transaction(
        kafka_topics, monkeypatch) -> None:
    """One transaction: a checkpoint's records of two partitions through `_produce_all`, once on the direct path
    (partition 1) and once through `produce` (partition 2, the Python loop), with tombstones among the ledger changes.
    Each partition of each topic reads back the same records in the same order, and the delivery reports are the
    ones `_produce_all` asks for, with the offsets the records got."""
    monkeypatch.setenv(native.ENV, native.COMPILED)
    topics = {logical: kafka_topics.name(logical) for logical in checkpoint.OUTPUT_TOPICS}
    topics["ledger-ticks"] = kafka_topics.name("ledger-ticks")
    topics["ledger-changelog"] = kafka_topics.name("ledger-changelog")
    producer = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers,
                         "transactional.id": f"{kafka_topics.prefix}direct", "log_level": 0})
    producer.init_transactions(TIMEOUT_S)
    assert direct_produce.direct(producer)
    codec = default_codec()
    built, changes = [], {}
    for partition in (1, 2):
        task = PartitionTask(partition, MemoryStore(), codec, 0, 4)
        task.records.extend(_records(400, size=300))
        changes[partition] = [(b"ledger-%d" % n, None if n % 7 == 3 else b"v" * (n % 50)) for n in range(300)]
        built.append(task)
    reports = []
    producer.begin_transaction()
    before = native.module().direct_produce_count()
    checkpoint._produce_all(producer, built[:1], changes, topics, lambda err, msg: reports.append(
        (err, msg.topic(), msg.partition(), msg.offset())))
    direct_count = native.module().direct_produce_count() - before
    monkeypatch.setenv(native.ENV, native.PYTHON)
    checkpoint._produce_all(producer, built[1:], changes, topics, lambda err, msg: reports.append(
        (err, msg.topic(), msg.partition(), msg.offset())))
    assert native.module().direct_produce_count() - before == direct_count  # the Python loop: none directly
    assert producer.flush(TIMEOUT_S) == 0
    producer.commit_transaction(TIMEOUT_S)

    used = {topics[logical] for logical, _, _ in _records(4)} | {topics["ledger-changelog"]}
    for name in used:
        direct_read = _read(kafka_topics.bootstrap_servers, name, 1)
        python_read = _read(kafka_topics.bootstrap_servers, name, 2)
        assert direct_read, name
        assert [(k, v) for k, v, _ in direct_read] == [(k, v) for k, v, _ in python_read], name
    changelog = _read(kafka_topics.bootstrap_servers, topics["ledger-changelog"], 1)
    assert [(k, v) for k, v, _ in changelog] == changes[1]
    results = _read(kafka_topics.bootstrap_servers, topics["settlement-results"], 1)
    assert [(k, v) for k, v, _ in results] == [(k, v) for t, k, v in built[0].records if t == "settlement-results"]
    # One report per topic-partition (its last record), with that record's offset, for both paths alike.
    assert all(err is None for err, *_ in reports)
    by_partition = {}
    for _, topic, partition, offset in reports:
        by_partition.setdefault(partition, {})[topic] = offset
    assert by_partition[1] == by_partition[2]
    assert set(by_partition[1]) == used
    # every record of partition 1 went to librdkafka directly but the last of each topic (its delivery report)
    assert direct_count == len(built[0].records) + len(changes[1]) - len(used)
    for topic, offset in by_partition[1].items():
        assert offset == _read(kafka_topics.bootstrap_servers, topic, 1)[-1][2]


@pytest.mark.unit
@needs_compiled
def test_the_producer_settle_run_makes_takes_the_direct_path(monkeypatch) -> None:
    """`settle run`'s transactional producer (processor_clients.producer_settings, not yet initialised: no broker
    needed) is confluent-kafka's own Producer with its librdkafka found: the direct path is taken, as the startup
    log says."""
    from branch_settlement.processors.kafka.config import ProcessorConfig
    from branch_settlement.processors.kafka.processor_clients import producer_settings

    monkeypatch.setenv(native.ENV, native.COMPILED)
    config = ProcessorConfig(bootstrap_servers="127.0.0.1:1")
    assert direct_produce.direct(Producer({**producer_settings(config), "log_level": 0}))
