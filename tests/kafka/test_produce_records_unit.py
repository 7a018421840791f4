"""A checkpoint's records handed to the producer: the compiled loop (native/src/produce.rs `produce_records`) makes
the calls the Python loop of `_produce_all` makes, in the same order, with a delivery report on the same records,
and a record librdkafka refuses as too large stops the same partition with the same words.

A real librdkafka producer, never connected: produce() only queues, and refuses a record larger than its
message.max.bytes at once."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from branch_settlement.processors.kafka import checkpoint
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import default_codec

pytestmark = [pytest.mark.unit, pytest.mark.skipif(native.module() is None, reason="needs the compiled module")]

TOPICS = {"settlement-results": "t.results", "capacity-releases": "t.releases", "settlement-audit": "t.audit",
          "ledger-ticks": "t.ticks", "branch-events-dlq": "t.dlq", "ledger-changelog": "t.changelog"}


class RecordingProducer(Producer):
    """A librdkafka producer that also notes each produce call's arguments (a subclass: the calls still go to
    librdkafka, which queues them or refuses them). Its first call meets a full queue (BufferError), as under
    load: the loop must poll and produce the same record again."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.calls: list[tuple] = []
        self.full_once = True

    def produce(self, topic, value=None, key=None, partition=-1, on_delivery=None):
        if self.full_once:
            self.full_once = False
            raise BufferError("Local: Queue full")
        self.calls.append((topic, value, key, partition, on_delivery is not None))
        if on_delivery is None:
            return super().produce(topic, value, key, partition)
        return super().produce(topic, value, key, partition, on_delivery)


def producer(max_bytes: int = 1_000_000) -> RecordingProducer:
    return RecordingProducer({"bootstrap.servers": "127.0.0.1:1", "message.max.bytes": max_bytes,
                              "log_level": 0})


def tasks(sizes: dict[int, int]) -> tuple[list[PartitionTask], dict[int, list]]:
    codec = default_codec()
    built, changes = [], {}
    for partition, size in sizes.items():
        task = PartitionTask(partition, MemoryStore(), codec, 0, 4)
        for n in range(6):
            topic = ("settlement-results", "capacity-releases", "settlement-audit", "ledger-ticks")[n % 4]
            task.records.append((topic, f"P{n}".encode(), bytes([n]) * (size if n == 4 else 10)))
        # A partition whose checkpoint changed no ledger record (only ticks that fired nothing, say) has none.
        changes[partition] = [(b"k%d" % n, None if n == 1 else b"v" * 5) for n in range(3 if partition < 3 else 0)]
        built.append(task)
    return built, changes


def produce_all(compiled: bool, every_record: bool, monkeypatch, max_bytes: int = 1_000_000, sizes=None):
    monkeypatch.setenv(native.ENV, native.COMPILED if compiled else native.PYTHON)
    p = producer(max_bytes)
    built, changes = tasks(sizes or {0: 10, 3: 10})
    failure = None
    try:
        checkpoint._produce_all(p, built, changes, TOPICS, lambda err, msg: None, every_record)
    except KafkaException as exc:
        failure = exc.args[0].code()
    return p.calls, [task.too_large for task in built], failure


@pytest.mark.parametrize("every_record", [False, True])
def test_the_compiled_loop_makes_the_python_loops_produce_calls(every_record, monkeypatch) -> None:
    assert native.compiled_function("produce_records") is not None or native.select() != native.COMPILED
    got = produce_all(True, every_record, monkeypatch)
    want = produce_all(False, every_record, monkeypatch)
    assert got == want
    calls, too_large, failure = got
    assert failure is None and too_large == [None, None]
    assert len(calls) == 2 * 6 + 3
    reported = [n for n, call in enumerate(calls) if call[4]]
    if every_record:
        assert reported == list(range(len(calls)))
    else:  # the last record of each topic per partition, and its last ledger change
        assert reported == [2, 3, 4, 5, 8, 11, 12, 13, 14]


def test_a_record_too_large_for_the_producer_names_its_partition_either_way(monkeypatch) -> None:
    sizes = {0: 10, 3: 5_000}
    got = produce_all(True, False, monkeypatch, max_bytes=2_000, sizes=sizes)
    want = produce_all(False, False, monkeypatch, max_bytes=2_000, sizes=sizes)
    assert got == want
    calls, too_large, failure = got
    assert failure == KafkaError.MSG_SIZE_TOO_LARGE
    assert too_large[0] is None
    assert too_large[1] == ("a record of 5000 bytes for t.results[3] is larger than the producer accepts "
                            "(its message.max.bytes)")
    assert calls[-1][0] == "t.results" and calls[-1][3] == 3  # nothing produced after the refused record
