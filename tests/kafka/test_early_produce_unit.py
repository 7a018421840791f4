"""Outputs produced into the open transaction as they are folded (Processor._produce_folded,
checkpoint.Transaction): the checkpoint commits exactly what it would have committed producing everything itself,
and a partition whose work is discarded before the commit (stopped, lost, a record refused) aborts the transaction
instead of committing its outputs without its offsets. Against the simulation's broker and clients (faults/sim.py),
which keep Kafka's transaction semantics."""

from __future__ import annotations

import random
import threading

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from branch_settlement.processors.kafka import rebalance
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.processor import Processor
from faults import sim

pytestmark = pytest.mark.unit

SEED, EVENTS, BATCH = 5, 160, 4  # BATCH per partition and consume call: below the checkpoint's record count


class Run:
    def __init__(self, producer_class=sim.FakeProducer) -> None:
        inputs, clock, _ = sim.partition_inputs(SEED, EVENTS)
        self.broker = sim.Broker(inputs, {})
        plan = sim.Plan(random.Random(0))
        self._patch = sim.patched(plan, self.broker, {})
        self._patch.__enter__()
        self.processor = p = Processor(sim.CONFIG, sim.TOPICS, sim.CODEC, Metrics())
        p._new_producer = lambda: producer_class(self.broker, plan)
        p._partition_count = lambda consumer: sim.PARTITIONS
        p.producer = p._new_producer()
        p.consumer = self.consumer = sim.FakeConsumer(self.broker, plan)
        p._on_assign(self.consumer, [TopicPartition("branch-events", n) for n in range(sim.PARTITIONS)])

    def close(self) -> None:
        self._patch.__exit__(None, None, None)

    def fold(self, early: bool) -> None:
        self.processor._fold_batch(self.consumer.consume(BATCH))
        if early:
            self.processor._produce_folded()

    def to_the_end(self, early: bool, every: int = 3) -> None:
        n = 0
        while not self.consumer.done():
            n += 1
            self.fold(early)
            if n % every == 0:
                assert self.processor.checkpoint()
        assert self.processor.checkpoint()

    def committed(self, partition: int | None = None) -> dict:
        outputs = sim.committed_outputs(self.broker)
        if partition is not None:
            outputs = {k: v for k, v in outputs.items() if k[1] == partition}
        return outputs

    def committed_records(self, partition: int) -> int:
        return sum(len(self.broker.log(topic, partition).committed()) for topic in sim.TOPICS.values())


@pytest.fixture
def runs():
    made = []

    def make(**kwargs) -> Run:
        made.append(Run(**kwargs))
        return made[-1]

    yield make
    for run in made:
        run.close()


def test_outputs_produced_as_folded_commit_exactly_what_producing_at_the_checkpoint_commits(runs) -> None:
    reference = runs()
    reference.to_the_end(early=False)
    run = runs()
    run.fold(early=True)
    # In the open transaction, readable by nobody yet.
    pending = {topic for topic, _, _ in run.broker.open_txn["entries"]}
    assert "settlement-results" in pending and "ledger-changelog" not in pending
    assert all(not run.broker.log(topic, p).committed() for topic in sim.TOPICS.values() for p in (0, 1))
    run.to_the_end(early=True)
    assert run.committed() == reference.committed()
    for p in (0, 1):
        assert sim.changelog_ledger(run.broker, p) == sim.changelog_ledger(reference.broker, p)
    assert run.broker.group_offsets == reference.broker.group_offsets == {
        p: len(run.broker.inputs[p]) for p in (0, 1)}


def _discarded_then_rest(run: Run, reference: Run, discard) -> None:
    """Fold a batch into the transaction, discard partition 0's work with `discard`: the checkpoint aborts, commits
    nothing, rewinds partition 1, whose outputs are then committed once, as in a run without it."""
    processor = run.processor
    run.fold(early=True)
    assert 0 in processor.transaction.partitions
    discard(processor)
    assert processor._checkpoint_due()
    assert not processor.checkpoint()
    assert run.committed_records(0) == run.committed_records(1) == 0 and run.broker.group_offsets == {}
    task = processor.tasks.get(1)
    assert task.next_offset == task.committed_position and task.position is None
    run.consumer.seek(TopicPartition("branch-events", 0, len(run.broker.inputs[0])))  # partition 0 is done with
    run.to_the_end(early=True)
    assert run.committed(1) == reference.committed(1)
    assert run.committed_records(0) == 0


def test_a_partition_stopped_with_outputs_in_the_transaction_aborts_it(runs) -> None:
    reference = runs()
    reference.to_the_end(early=False)
    run = runs()
    _discarded_then_rest(run, reference, lambda p: p._stop_partition(p.tasks[0], RuntimeError("a test's bug")))
    assert run.processor.tasks[0].stopped == "a test's bug"


def test_a_partition_lost_with_outputs_in_the_transaction_aborts_it(runs) -> None:
    reference = runs()
    reference.to_the_end(early=False)
    run = runs()
    _discarded_then_rest(run, reference, lambda p: rebalance.on_lost(p, p.consumer, [
        TopicPartition("branch-events", 0)]))
    assert 0 not in run.processor.tasks


def test_a_partition_stopped_with_nothing_in_the_transaction_leaves_the_others_to_commit(runs) -> None:
    run = runs()
    processor = run.processor
    run.fold(early=False)
    processor._stop_partition(processor.tasks[0], RuntimeError("a test's bug"))
    assert processor.transaction is None
    assert processor.checkpoint()
    assert run.committed_records(1) > 0 and run.committed_records(0) == 0


class RefusingProducer(sim.FakeProducer):
    """Refuses partition 0's first result as too large, as librdkafka does past its message.max.bytes."""

    refused = False

    def produce(self, topic, value=None, key=None, partition=None, on_delivery=None) -> None:
        if topic == "settlement-results" and partition == 0 and not RefusingProducer.refused:
            RefusingProducer.refused = True
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Message size too large"))
        super().produce(topic, value, key, partition, on_delivery)


def test_a_record_refused_as_it_is_produced_aborts_the_transaction_and_stops_its_partition(runs) -> None:
    run = runs(producer_class=RefusingProducer)
    processor = run.processor
    run.fold(early=True)
    assert RefusingProducer.refused
    assert "larger than the producer accepts" in processor.tasks[0].stopped
    assert processor.transaction is None and run.broker.group_offsets == {}
    assert run.committed_records(0) == run.committed_records(1) == 0
    run.to_the_end(early=True)
    assert run.committed_records(1) > 0 and run.committed_records(0) == 0
    assert run.broker.group_offsets == {1: len(run.broker.inputs[1])}


def test_a_producer_given_up_on_a_stuck_call_is_purged_and_its_transaction_never_commits(runs, monkeypatch) -> None:
    """librdkafka can block in send_offsets_to_transaction past its timeout after a broker restart: the processor
    gives that producer up and replays with a new one (docs/faults.md, finding 1). The given-up producer stays
    alive, so what it still holds is purged; its transaction is aborted by the new producer's fence, and the run
    commits exactly what an undisturbed run commits."""
    from branch_settlement.processors.kafka import processor as processor_module, txn_guard

    monkeypatch.setattr(txn_guard, "MARGIN_S", 0.0)
    monkeypatch.setattr(processor_module, "call_timeout_s", lambda config: 0.2)
    release = threading.Event()

    class StuckOnce(sim.FakeProducer):
        stuck = False

        def send_offsets_to_transaction(self, offsets, metadata, timeout=None) -> None:
            if not StuckOnce.stuck:
                StuckOnce.stuck = True
                release.wait(30)  # the stuck call: it returns only once the test lets it
            return super().send_offsets_to_transaction(offsets, metadata, timeout)

    reference = runs()
    reference.to_the_end(early=True)
    run = runs(producer_class=StuckOnce)
    for _ in range(3):
        run.fold(early=True)
    given_up = run.processor.producer
    assert not run.processor.checkpoint()  # stuck: given up, nothing committed
    assert run.processor.producer is not given_up
    assert given_up.purges == [(True, True, False)]
    assert given_up._fenced()
    release.set()  # the stuck call returns now: into a fenced producer, whose transaction was aborted
    run.to_the_end(early=True)
    assert run.committed() == reference.committed()
    assert not any(entry[2] == "pending" for topic in sim.TOPICS.values() for p in range(sim.PARTITIONS)
                   for entry in run.broker.log(topic, p).entries)
