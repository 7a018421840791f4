"""Ledger time without a broker: the processor's own ticks (folded at its input position, buffered for
ledger-ticks keyed by that position), Ticks and misrouted events among the input (they change nothing), the
replay's merge of ledger-ticks back into the input, and the rewind after a failed checkpoint."""

from __future__ import annotations

import pytest
from confluent_kafka import TopicPartition

from branch_settlement.processors.crosscheck.readers import tick_input
from branch_settlement.processors.kafka.checkpoint import rewind
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.processors.kafka.ticks import FileClock, anchor_of, schedule_ticks, tick_event
from branch_settlement.processors.ledger import results
from branch_settlement.processors.replay.replayer import Input, merge_ticks, replay
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.partitioning import partition_of

pytestmark = pytest.mark.unit

CODEC = default_codec()
T0 = 1_764_410_400_000
PARTITIONS = 4


def parent_in(partition: int, stem: str = "wf") -> str:
    return next(f"{stem}-{n}" for n in range(10_000) if partition_of(f"{stem}-{n}", PARTITIONS) == partition)


def reserved(parent_id: str, n: int = 1) -> dict:
    return CODEC.event_from_json({
        "type": "ParentReserved", "event_id": f"e-{parent_id}-{n}", "idempotency_key": f"{parent_id}/ParentReserved/{n}",
        "parent_id": parent_id, "occurred_at_ms": T0, "capacity": {"tokens": {"quantity": 100, "kind": "logical"}},
        "lease_ttl_ms": 5_000, "policy": {"max_live_children": 4, "reconciliation_timeout_ms": 1000}})


def task(partition: int = 1) -> PartitionTask:
    return PartitionTask(partition, MemoryStore(), CODEC, -2, PARTITIONS)


def test_a_tick_is_folded_at_the_input_position_and_buffered_for_ledger_ticks_under_it() -> None:
    t = task()
    own = parent_in(1)
    t.next_offset = 7  # inputs 0..6 folded
    result = t.fold_tick(tick_event(1, T0))
    assert result["result"] == results.OK and result["input_offset"] == 7
    assert t.view.meta["ledger_time_ms"] == T0
    ticks = [(key, value) for topic, key, value in t.records if topic == "ledger-ticks"]
    assert len(ticks) == 1 and anchor_of(ticks[0][0]) == 7
    assert CODEC.decode_event(ticks[0][1]) == tick_event(1, T0)
    assert t.position == 7  # the checkpoint commits the (unchanged) input position with the group's metadata
    assert t.apply(reserved(own), 7)["result"] == results.OK


def test_a_fresh_partition_anchors_its_first_tick_at_offset_0() -> None:
    t = task()
    assert t.next_offset == -2  # OFFSET_BEGINNING: nothing committed yet
    t.fold_tick(tick_event(1, T0))
    assert [anchor_of(key) for topic, key, _ in t.records if topic == "ledger-ticks"] == [0]
    assert t.position == 0


def test_a_tick_on_the_input_topic_changes_nothing() -> None:
    t = task()
    forged = tick_event(1, T0 + 10 * 365 * 86_400_000)
    result = t.apply(forged, 0)
    assert result["result"] == results.TICK_NOT_ACCEPTED
    assert t.view.meta["ledger_time_ms"] == 0 and t.view.changes() == []


def test_an_event_of_a_parent_of_another_partition_is_misrouted_and_changes_nothing() -> None:
    t = task(1)
    foreign = parent_in(2)
    result = t.apply(reserved(foreign), 0)
    assert result["result"] == results.MISROUTED
    assert "belongs to partition 2 of 4" in result["detail"]
    assert t.view.parent(foreign) is None and t.view.changes() == []
    # and its own partition opens it
    other = task(2)
    assert other.apply(reserved(foreign), 0)["result"] == results.OK


def test_schedule_ticks_ticks_every_running_partition_once_per_interval() -> None:
    tasks = [task(0), task(1)]
    tasks[1].stopped = "invariant violation"
    now = [T0 / 1000]
    assert schedule_ticks(tasks, 1000, lambda: now[0]) == 1
    assert schedule_ticks(tasks, 1000, lambda: now[0] + 0.5) == 0
    assert schedule_ticks(tasks, 1000, lambda: now[0] + 1) == 1
    assert schedule_ticks(tasks, 0, lambda: now[0] + 100) == 0  # 0: no ticks
    assert tasks[0].view.meta["ledger_time_ms"] == T0 + 1000


def test_the_file_clock_reads_the_time_in_the_file_and_never_goes_back(tmp_path) -> None:
    path = tmp_path / "clock"
    clock = FileClock(str(path))
    assert clock() == 0.0  # no file yet: no time, so no tick
    path.write_text(f"{T0}\n")
    assert clock() == T0 / 1000
    path.write_text("not a time")
    assert clock() == T0 / 1000
    path.write_text(f"{T0 - 5}")
    assert clock() == T0 / 1000
    path.write_text(f"{T0 + 61_000}")
    assert clock() == (T0 + 61_000) / 1000


def test_merge_puts_each_tick_before_the_first_input_at_or_past_its_anchor() -> None:
    inputs = [Input(o, {"n": o}) for o in (0, 1, 3, 4)]  # offset 2: a transaction marker
    ticks = [Input(a, {"t": a}, ledger_tick=True) for a in (0, 2, 2, 5, 9)]
    merged = [(i.ledger_tick, i.offset) for i in merge_ticks(inputs, ticks, end=5)]
    assert merged == [(True, 0), (False, 0), (False, 1), (True, 2), (True, 2), (False, 3), (False, 4), (True, 5)]
    assert [(i.ledger_tick, i.offset) for i in merge_ticks([], ticks, None)][-1] == (True, 9)


def test_a_replay_of_the_merged_partition_derives_what_the_processor_folded() -> None:
    live = task(1)
    own = parent_in(1)
    folded = []
    live.next_offset = 0
    folded.append(live.fold_tick(tick_event(1, T0)))
    folded.append(live.apply(reserved(own), 0))
    live.next_offset = 1
    folded.append(live.apply(tick_event(1, T0 + 10**9), 1))  # a forged one, on the input
    live.next_offset = 2
    folded.append(live.fold_tick(tick_event(1, T0 + 6_000)))  # the parent's lease expires
    records = [(topic, key, value) for topic, key, value in live.records]
    ticks = [tick_input(CODEC, n, key, value) for n, (topic, key, value) in
             enumerate(r for r in records if r[0] == "ledger-ticks")]
    inputs = [Input(0, reserved(own)), Input(1, tick_event(1, T0 + 10**9))]
    result, _ = replay(merge_ticks(inputs, ticks, end=2), partition=1, partitions=PARTITIONS, audit_ledger=True)
    assert result.outputs.results == folded
    assert [r["result"] for r in folded] == [results.OK, results.OK, results.TICK_NOT_ACCEPTED, results.OK]
    assert any(r["reason"] == "parent_lease_expired" or r["destination"] == "global_pool"
               for r in result.outputs.releases)


def test_a_ledger_ticks_record_that_is_not_a_tick_is_a_dead_letter() -> None:
    assert tick_input(CODEC, 3, b"x", CODEC.encode_event(tick_event(0, T0))).event is None
    not_tick = tick_input(CODEC, 3, b"5", CODEC.encode_event(reserved(parent_in(0))))
    assert not_tick.event is None and "not a Tick" in not_tick.reason and not_tick.offset == 5


class _Consumer:
    def __init__(self) -> None:
        self.seeks: list[tuple[int, int]] = []

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.partition, tp.offset))


def test_rewind_seeks_the_partitions_that_folded_nothing_since_the_commit_too() -> None:
    """A failed checkpoint drops the rest of the consumed batch (Processor._fold_batch): a partition that had
    folded nothing since the commit may have records in it, fetched already. Found by faults/sim.py (seed 303):
    without the seek they never came again and the next commit skipped them."""
    folded, idle = task(0), task(1)
    folded.committed_position, folded.next_offset = 31, 33
    idle.committed_position, idle.next_offset = 31, 31
    consumer = _Consumer()
    rewind(consumer, [folded, idle], {"branch-events": "branch-events"})
    assert sorted(consumer.seeks) == [(0, 31), (1, 31)]
    assert folded.next_offset == idle.next_offset == 31


@pytest.mark.parametrize("key, expected", [  # Kafka's own vectors (clients UtilsTest.testMurmur2), as int32
    ("21", -973932308), ("foobar", -790332482), ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829), ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    ("abc", 479470107)])
def test_murmur2_is_kafkas(key: str, expected: int) -> None:
    from branch_settlement.schemas.partitioning import murmur2

    assert murmur2(key.encode()) == expected & 0xFFFFFFFF
    assert partition_of(key, 8) == (expected & 0x7FFFFFFF) % 8


class _RefusingProducer:
    """A transactional producer whose broker refuses records over `limit` bytes: a delivery report says so
    for the records that asked for one, and the transaction can then only abort."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending: list = []
        self.refused = False

    def begin_transaction(self) -> None:
        self.pending, self.refused = [], False

    def produce(self, topic, value=None, key=None, partition=None, on_delivery=None) -> None:
        self.pending.append((topic, partition, value, on_delivery))

    def flush(self, timeout=None) -> int:
        from confluent_kafka import KafkaError

        for offset, (topic, partition, value, callback) in enumerate(self.pending):
            too_large = len(value or b"") > self.limit
            self.refused |= too_large
            if callback is not None:
                callback(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large") if too_large else None,
                         _Delivered(topic, partition, offset, value))
        self.pending = []
        return 0

    def send_offsets_to_transaction(self, offsets, metadata, timeout=None) -> None:
        from confluent_kafka import KafkaError, KafkaException

        if self.refused:
            raise KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT, "abortable", txn_requires_abort=True))

    def commit_transaction(self, timeout=None) -> None:
        self.send_offsets_to_transaction(None, None)  # librdkafka: abortable once any record failed

    def abort_transaction(self, timeout=None) -> None:
        pass


class _Delivered:
    def __init__(self, topic, partition, offset, value) -> None:
        self._t, self._p, self._o, self._v = topic, partition, offset, value

    def topic(self): return self._t
    def partition(self): return self._p
    def offset(self): return self._o
    def value(self): return self._v


class _GroupConsumer(_Consumer):
    def consumer_group_metadata(self) -> object:
        return object()


def test_a_record_the_broker_refuses_is_told_apart_on_the_checkpoint_after() -> None:
    """Only the last record of each topic-partition asks for a delivery report: a refused record in the middle
    fails the transaction unattributed. The checkpoint after a failed one asks for a report per record, so it
    names the partition (Processor.checkpoint then stops it) instead of failing the same way for ever."""
    from branch_settlement.processors.kafka.checkpoint import commit_checkpoint

    topics = {name: name for name in ("branch-events", "ledger-changelog", "ledger-ticks", "settlement-results",
                                      "capacity-releases", "settlement-audit", "branch-events-dlq")}
    own = parent_in(1)

    def child(event_type: str, key: str, **fields) -> dict:
        return CODEC.event_from_json({"type": event_type, "event_id": key, "idempotency_key": key, "parent_id": own,
                                      "occurred_at_ms": T0, **fields})

    def fold(t: PartitionTask) -> None:  # a large audit record (the skip's reason) that is not the last
        t.next_offset = 0
        for offset, e in enumerate([reserved(own),
                                    child("ChildReserved", "k/c", child_id="A", branch_id="A", attempt_id="A1",
                                          quantities={"tokens": 5}),
                                    child("ChildSkipped", "k/s", child_id="A", attempt_id="A1", reason="x" * 20_000),
                                    child("ChildReserved", "k/c2", child_id="B", branch_id="B", attempt_id="B1",
                                          quantities={"tokens": 1})]):
            t.apply(e, offset)
        t.next_offset = t.position = 4

    t = task(1)
    fold(t)
    audits = [len(v) for topic, _, v in t.records if topic == "settlement-audit"]
    assert max(audits) > 8000 and audits[-1] < 8000
    producer, consumer = _RefusingProducer(8000), _GroupConsumer()
    assert not commit_checkpoint(producer, consumer, [t], topics, 5.0).committed
    assert t.too_large is None  # unattributed: the refused record asked for no report
    fold(t)  # folded again after the rewind
    assert not commit_checkpoint(producer, consumer, [t], topics, 5.0, report_every_record=True).committed
    assert t.too_large is not None and "settlement-audit[1]" in t.too_large and "max.message.bytes" in t.too_large
