"""Deterministic simulation without Kafka: the real processor code (branch_settlement.processors.kafka: the
Processor's fold loop, its recovery from each checkpoint failure, checkpoint.commit_checkpoint, PartitionTask,
restore.restore; the fold, LedgerView, MemoryStore) driven against a simulated log with
transactions, from a seed.

The simulated broker keeps, per topic partition, a log of entries that are pending, committed or aborted
(aborted records keep their offsets, as in Kafka), and the group's committed offsets, which a transaction
commits atomically with its records. Readers see committed entries below the first pending one
(read_committed). Only the edges are simulated: the producer and consumer (fakes with Kafka's transaction
semantics), the restore consumer, the store factory (a MemoryStore per partition that survives crashes, as
RocksDB on disk does) and the crash hook (branch_settlement.processors.kafka.faults.crash_point raises SimCrash instead of
exiting).

A run (one seed) folds an adversarial stream (faults/adversity.py: duplicates, reordering, late and stale
reports, malformed records) over two partitions with, chosen by the seed: crashes at every step of the commit
sequence and in the middle of restores, crashes between folds, deleted projections, redelivered messages,
and broker errors (failed deliveries, fenced producers, offsets that time out, retriable commit errors, commits that must abort,
commits whose outcome is unknown, committed or not). Then everything committed is compared with a run
without faults and with the offline fold, which runs the ledger auditor after every event.
`python -m faults.sim --runs 5000`; a failure prints the seed and `python -m faults.sim --seed N` reproduces it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, TopicPartition

import branch_settlement.processors.kafka.faults as kafka_faults
from branch_settlement.processors import gc_tuning
import branch_settlement.processors.kafka.assignment as assignment_mod
import branch_settlement.processors.kafka.recovery as recovery_mod
import branch_settlement.processors.kafka.restore as restore_mod
from faults.adversity import build
from branch_settlement.processors.workload import Mix
from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.processor import Processor
from branch_settlement.processors.kafka.ticks import tick_event
from branch_settlement.processors.replay.replayer import Input, ledger_snapshot, merge_ticks, replay
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas.codec import CodecError, default_codec
from branch_settlement.schemas.partitioning import partition_of
from branch_settlement.processors.ledger.outputs import OUTPUT_TOPICS

PARTITIONS = 2
TOPICS = {name: name for name in ("branch-events", "ledger-changelog", "ledger-ticks", "settlement-results",
                                  "capacity-releases", "settlement-audit", "branch-events-dlq")}
CRASH_POINTS = ("after_produce", "after_send_offsets", "after_commit", "mid_restore")
BROKER_FAULTS = ("delivery_failed", "fenced", "send_offsets_timed_out", "commit_retriable", "commit_requires_abort",
                 "commit_unknown_committed", "commit_unknown_not_committed")
CODEC = default_codec()
# Small parents, many at once: short streams in which parents open, settle, expire and close.
SIM_MIX = Mix(min_children=2, max_children=6, concurrent_parents=4, timeouts=0.1, retries=0.15, speculative=0.1)


class SimCrash(BaseException):
    """The simulated process died here (BaseException: nothing in the processor may catch it)."""


class PartitionStopped(Exception):
    """The processor stopped a partition (a bug in the fold, or state the log does not have): the run would
    wait for a fix forever. Reported with its seed."""


# -- the simulated broker -----------------------------------------------------------------------------------


class Log:
    """One topic partition: entries [key, value, status], status pending | committed | aborted."""

    def __init__(self) -> None:
        self.entries: list[list] = []

    def lso(self) -> int:
        for i, entry in enumerate(self.entries):
            if entry[2] == "pending":
                return i
        return len(self.entries)

    def committed(self, start: int = 0) -> list[tuple[int, bytes | None, bytes | None]]:
        return [(i, e[0], e[1]) for i, e in enumerate(self.entries[:self.lso()]) if i >= start and e[2] == "committed"]


@dataclass
class Broker:
    inputs: dict[int, list[bytes]]
    # The ledger time the processor's clock shows as each partition reaches an input offset: (offset, now_ms).
    clock: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    logs: dict[tuple[str, int], Log] = field(default_factory=dict)
    group_offsets: dict[int, int] = field(default_factory=dict)
    open_txn: dict | None = None  # {"epoch", "entries": [(topic, p, index)], "offsets": {p: offset}}
    epoch: int = 0

    def log(self, topic: str, partition: int) -> Log:
        return self.logs.setdefault((topic, partition), Log())

    def end_txn(self, commit: bool) -> None:
        txn, self.open_txn = self.open_txn, None
        if txn is None:
            return
        for topic, p, index in txn["entries"]:
            self.log(topic, p).entries[index][2] = "committed" if commit else "aborted"
        if commit:
            self.group_offsets.update(txn["offsets"])

    def init_producer(self) -> int:
        """InitProducerId: aborts the open transaction of the previous producer with this id, fences it."""
        self.end_txn(commit=False)
        self.epoch += 1
        return self.epoch


class Message:
    def __init__(self, topic: str, partition: int, offset: int, key, value, error: KafkaError | None = None):
        self._t, self._p, self._o, self._k, self._v, self._e = topic, partition, offset, key, value, error

    def topic(self): return self._t
    def partition(self): return self._p
    def offset(self): return self._o
    def key(self): return self._k
    def value(self): return self._v
    def error(self): return self._e


def _raise(code: int, **flags) -> None:
    raise KafkaException(KafkaError(code, "simulated", **flags))


class FakeProducer:
    """A transactional producer with Kafka's semantics; `faults` says which call fails next, and how."""

    def __init__(self, broker: Broker, plan: "Plan") -> None:
        self.broker = broker
        self.plan = plan
        self.epoch = broker.init_producer()
        self.deliveries: list = []
        self.purges: list = []
        # A delivery failed in this transaction: like librdkafka, the transaction is then in the abortable
        # error state, and sending offsets or committing says so, whether or not a callback saw the failure.
        self.txn_failed = False

    def _fenced(self) -> bool:
        return self.epoch != self.broker.epoch

    def begin_transaction(self) -> None:
        if self._fenced():
            _raise(KafkaError._FENCED, fatal=True)
        self.broker.open_txn = {"epoch": self.epoch, "entries": [], "offsets": {}}
        self.txn_failed = False

    def produce(self, topic, value=None, key=None, partition=None, on_delivery=None) -> None:
        log = self.broker.log(topic, partition)
        log.entries.append([key, value, "pending"])
        self.broker.open_txn["entries"].append((topic, partition, len(log.entries) - 1))
        self.deliveries.append((on_delivery, Message(topic, partition, len(log.entries) - 1, key, value)))

    def poll(self, timeout=0) -> int:
        return 0

    def __len__(self) -> int:
        """Messages produced and not yet delivered (the processor's queue gauge)."""
        return len(self.deliveries)

    def flush(self, timeout=None) -> int:
        failure = self.plan.take("delivery_failed")
        self.txn_failed = self.txn_failed or (failure and bool(self.deliveries))
        for callback, msg in self.deliveries:
            if callback is not None:
                callback(KafkaError(KafkaError._MSG_TIMED_OUT, "simulated") if failure else None, msg)
        self.deliveries.clear()
        return 0

    def purge(self, in_queue=True, in_flight=True, blocking=True) -> None:
        """Drops what is not delivered yet, reporting nothing (librdkafka reports _PURGE_QUEUE to callbacks that only
        a poll of this producer would serve); records already in the log stay for the transaction's end."""
        self.purges.append((in_queue, in_flight, blocking))
        self.deliveries.clear()
        self.txn_failed = True  # like librdkafka: a transaction with purged records can only abort

    def send_offsets_to_transaction(self, offsets, metadata, timeout=None) -> None:
        if self.plan.take("fenced"):
            self.broker.init_producer()  # another producer with this id took over: this one is fenced
            _raise(KafkaError._FENCED, fatal=True)
        if self._fenced():
            _raise(KafkaError._FENCED, fatal=True)
        if self.txn_failed:
            _raise(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)
        if self.plan.take("send_offsets_timed_out"):
            _raise(KafkaError._TIMED_OUT, retriable=True)  # a coordinator that does not answer in time
        self.broker.open_txn["offsets"] = {tp.partition: tp.offset for tp in offsets}

    def commit_transaction(self, timeout=None) -> None:
        if self._fenced():
            _raise(KafkaError._FENCED, fatal=True)
        if self.txn_failed:
            _raise(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)
        if self.plan.take("commit_retriable"):
            _raise(KafkaError._TIMED_OUT, retriable=True)
        if self.plan.take("commit_requires_abort"):
            _raise(KafkaError._TIMED_OUT, txn_requires_abort=True)
        if self.plan.take("commit_unknown_committed"):
            self.broker.end_txn(commit=True)
            _raise(KafkaError._TRANSPORT)
        if self.plan.take("commit_unknown_not_committed"):
            _raise(KafkaError._TRANSPORT)
        self.broker.end_txn(commit=True)

    def abort_transaction(self, timeout=None) -> None:
        if not self._fenced():
            self.broker.end_txn(commit=False)

    def init_transactions(self, timeout=None) -> None:
        pass


class FakeConsumer:
    """The group member's consumer: reads the input from the committed offsets (read_committed: the input
    has no transactions), seeks, and now and then redelivers what it delivered already."""

    def __init__(self, broker: Broker, plan: "Plan") -> None:
        self.broker = broker
        self.plan = plan
        self.position = {p: broker.group_offsets.get(p, 0) for p in broker.inputs}

    def consumer_group_metadata(self) -> object:
        return object()

    def committed(self, partitions, timeout=None) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.broker.group_offsets.get(tp.partition, -1001))
                for tp in partitions]

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition("branch-events", p) for p in sorted(self.position)]

    def seek(self, tp: TopicPartition) -> None:
        self.position[tp.partition] = max(tp.offset, 0)  # OFFSET_BEGINNING (-2): the start

    def pause(self, partitions) -> None:
        for tp in partitions:
            self.position[tp.partition] = len(self.broker.inputs[tp.partition])

    def get_watermark_offsets(self, tp, cached=False, timeout=None):
        return 0, len(self.broker.inputs[tp.partition])

    def consume(self, count: int) -> list[Message]:
        rng = self.plan.rng
        out = []
        for p in sorted(self.position):
            start = self.position[p]
            if self.plan.take("redeliver") and start > 0:
                start = max(start - rng.randint(1, 5), 0)  # librdkafka refetching around a seek
            values = self.broker.inputs[p][start:start + count]
            out += [Message("branch-events", p, start + i, None, v) for i, v in enumerate(values)]
            self.position[p] = max(self.position[p], start + len(values))
        return out

    def done(self) -> bool:
        return all(self.position[p] >= len(self.broker.inputs[p]) for p in self.position)


class RestoreConsumer:
    """What the processor's restore sees of the changelog: read_committed, partition EOF at the LSO."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.assigned: dict[int, int] = {}
        self.eof_sent: set[int] = set()

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return 0, len(self.broker.log(tp.topic, tp.partition).entries)

    def assign(self, partitions) -> None:
        self.topic = partitions[0].topic
        self.assigned = {tp.partition: max(tp.offset, 0) for tp in partitions}

    def consume(self, num_messages=1, timeout=None) -> list[Message]:
        out = []
        for p, position in self.assigned.items():
            log = self.broker.log(self.topic, p)
            records = log.committed(position)[:num_messages]
            out += [Message(self.topic, p, i, k, v) for i, k, v in records]
            self.assigned[p] = records[-1][0] + 1 if records else max(position, log.lso())
            if not records:
                out.append(Message(self.topic, p, self.assigned[p], None, None, KafkaError(KafkaError._PARTITION_EOF)))
        return out

    def close(self) -> None:
        pass


# -- a run --------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What goes wrong in one run, drawn from its seed."""

    rng: random.Random
    crash_at: dict[str, set[int]] = field(default_factory=dict)  # point -> which occurrences crash
    rates: dict[str, float] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    injected: Counter = field(default_factory=Counter)

    def take(self, fault: str) -> bool:
        if self.rng.random() < self.rates.get(fault, 0.0):
            self.injected[fault] += 1
            return True
        return False

    def crash_point(self, name: str) -> None:
        self.counts[name] += 1
        if self.counts[name] in self.crash_at.get(name, ()):
            self.injected[f"crash_{name}"] += 1
            raise SimCrash(name)

    def pause_point(self, name: str) -> None:
        pass


@functools.lru_cache(maxsize=64)
def partition_inputs(seed: int, events: int) -> tuple[dict[int, list[bytes]], dict[int, list[tuple[int, int]]], Counter]:
    """The stream's events routed by the producer's partitioner, and its Ticks turned into the processor's
    clock: each partition ticks at the input offset where the stream had it (the processor's ticks are its
    own, on ledger-ticks; none is on the input)."""
    workload = build(seed, events, SIM_MIX)
    inputs: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    clock: dict[int, list[tuple[int, int]]] = {p: [] for p in range(PARTITIONS)}
    for n, record in enumerate(workload.records):
        if isinstance(record, str):
            inputs[n % PARTITIONS].append(record.encode())
            continue
        event = CODEC.event_from_json(record)
        if event["type"] == "Tick":
            for p in range(PARTITIONS):
                clock[p].append((len(inputs[p]), event["now_ms"]))
            continue
        inputs[partition_of(event["parent_id"], PARTITIONS)].append(CODEC.encode_event(event))
    return inputs, clock, workload.adversity


def make_due_ticks(processor: Processor, broker: Broker, p: int, offset: int) -> None:
    """The processor's clock: before partition `p` folds input `offset`, the ticks its ledger has not seen
    that the clock shows by then, folded as the processor folds its own (PartitionTask.fold_tick)."""
    task = processor.tasks.get(p)
    if task is None or task.stopped or offset < task.next_offset:
        return
    for anchor, now_ms in broker.clock.get(p, ()):
        if anchor > offset:
            break
        if now_ms > task.view.meta["ledger_time_ms"]:
            assert task.next_offset == anchor or task.next_offset < 0 and anchor == 0, (
                f"partition {p}: a tick due before input {anchor} was not folded before input {task.next_offset}")
            task.fold_tick(tick_event(p, now_ms))


@contextlib.contextmanager
def patched(plan: Plan, broker: Broker, stores: dict[int, MemoryStore]):
    saved = (kafka_faults.crash_point, kafka_faults.pause_point, restore_mod.Consumer, assignment_mod.open_store,
             assignment_mod.delete_store, recovery_mod.FENCE_BACKOFF_S)
    kafka_faults.crash_point = plan.crash_point
    kafka_faults.pause_point = plan.pause_point
    restore_mod.Consumer = lambda config: RestoreConsumer(broker)
    assignment_mod.open_store = lambda state_dir, group, p: stores.setdefault(p, MemoryStore())
    assignment_mod.delete_store = lambda state_dir, group, p: stores.pop(p, None)
    recovery_mod.FENCE_BACKOFF_S = 0.0
    try:
        yield
    finally:
        (kafka_faults.crash_point, kafka_faults.pause_point, restore_mod.Consumer, assignment_mod.open_store,
         assignment_mod.delete_store, recovery_mod.FENCE_BACKOFF_S) = saved


# Checkpoints come at random between batches (`checkpoint_rate`), and within a batch right after an event that
# leaves this many records buffered in its partition (Processor._fold_batch), so that a checkpoint failing there
# must also drop the rest of its batch.
SIM_COMMIT_RECORDS = 60
CONFIG = ProcessorConfig(bootstrap_servers="sim:0", worker_slot="sim", tick_interval_ms=0, commit_events=10**9,
                         commit_interval_ms=10**9, commit_records=SIM_COMMIT_RECORDS)


def simulate(inputs: dict[int, list[bytes]], clock: dict[int, list[tuple[int, int]]], plan: Plan,
             checkpoint_rate: float, max_incarnations: int = 200) -> tuple[Broker, dict[int, MemoryStore], int]:
    """Run processors until the input is folded and committed, and every tick; a crash starts a new
    incarnation."""
    broker = Broker(inputs, clock)
    stores: dict[int, MemoryStore] = {}
    incarnations = 0
    with patched(plan, broker, stores):
        while True:
            incarnations += 1
            if incarnations > max_incarnations:
                raise AssertionError(f"no progress after {max_incarnations} incarnations")
            if incarnations > 1 and plan.take("delete_projection"):
                stores.pop(plan.rng.randrange(PARTITIONS), None)
            processor = Processor(CONFIG, TOPICS, CODEC, Metrics())
            processor._new_producer = lambda: FakeProducer(broker, plan)
            processor._partition_count = lambda consumer: PARTITIONS
            try:
                if _incarnation(processor, broker, plan, checkpoint_rate):
                    return broker, stores, incarnations
            except SimCrash:
                continue


def _incarnation(processor: Processor, broker: Broker, plan: Plan, checkpoint_rate: float) -> bool:
    rng = plan.rng
    processor.producer = processor._new_producer()
    processor.consumer = consumer = FakeConsumer(broker, plan)
    processor._on_assign(consumer, [TopicPartition("branch-events", p) for p in sorted(broker.inputs)])
    for task in processor.tasks.values():  # librdkafka starts an assigned partition at its committed offset
        consumer.seek(TopicPartition("branch-events", task.partition, task.committed_position))
    fold = processor._fold

    def fold_then_maybe_crash(message):
        make_due_ticks(processor, broker, message.partition(), message.offset())
        task = fold(message)
        if plan.take("crash_between_folds"):
            raise SimCrash("between folds")
        return task

    processor._fold = fold_then_maybe_crash
    while True:
        processor._fold_batch(consumer.consume(rng.randint(1, 12)))
        stopped = [t for t in processor.tasks.values() if t.stopped]
        if stopped:  # an invariant violation: the partition would wait for a fix forever
            raise PartitionStopped(f"partition {stopped[0].partition} stopped: {stopped[0].stopped}")
        if consumer.done():  # the ticks after each partition's last input
            for p in broker.inputs:
                make_due_ticks(processor, broker, p, len(broker.inputs[p]))
        if rng.random() < checkpoint_rate or consumer.done():
            processor.checkpoint()
        elif rng.random() < 0.5:  # as step() does between checkpoints: the outputs into the open transaction
            processor._produce_folded()
        if consumer.done() and not any(t.has_work() for t in processor.tasks.values()) and all(
                broker.group_offsets.get(p, 0) == len(broker.inputs[p]) for p in broker.inputs) and all(
                len(broker.log("ledger-ticks", p).committed()) == len(broker.clock[p]) for p in broker.inputs):
            return True


def committed_outputs(broker: Broker) -> dict[tuple[str, int, str], list[bytes]]:
    """Committed output records per topic partition and record type, in offset order. Per type: a
    checkpoint writes all its CapacityReleased before all its ParentSettled, so how the two interleave on
    capacity-releases depends on where checkpoints fall (see docs/faults.md, findings)."""
    out: dict[tuple[str, int, str], list[bytes]] = {}
    for topic in OUTPUT_TOPICS:
        for p in range(PARTITIONS):
            out.setdefault((topic, p, "DeadLetter" if topic == "branch-events-dlq" else "SettlementResult"), [])
            for _, _, v in broker.log(topic, p).committed():
                out.setdefault((topic, p, CODEC.decode(v)[0]), []).append(v)
    for p in range(PARTITIONS):  # each tick once, keyed by the input offset it was folded before
        out[("ledger-ticks", p, "Tick")] = [k + b" " + v for _, k, v in broker.log("ledger-ticks", p).committed()]
    return out


def changelog_ledger(broker: Broker, p: int) -> dict:
    store = MemoryStore()
    store.write([(k, v) for _, k, v in broker.log("ledger-changelog", p).committed()], 0)
    return ledger_snapshot(store, CODEC)


@dataclass
class Reference:
    outputs: dict
    ledgers: dict
    offline: dict


_references: dict[tuple[int, int], Reference] = {}


def reference(seed: int, events: int) -> Reference:
    """The run without faults, checked against the offline fold once."""
    key = (seed, events)
    if key not in _references:
        inputs, clock, _ = partition_inputs(seed, events)
        broker, stores, _ = simulate(inputs, clock, Plan(random.Random(seed)), checkpoint_rate=0.3)
        outputs = committed_outputs(broker)
        offline = {}
        for p, values in inputs.items():
            items = []
            for offset, value in enumerate(values):
                try:
                    items.append(Input(offset, CODEC.decode_event(value)))
                except CodecError as exc:
                    items.append(Input(offset, None, str(exc)))
            ticks = [Input(anchor, tick_event(p, now_ms), ledger_tick=True) for anchor, now_ms in clock[p]]
            # The ledger auditor checks every balance term after every event of the reference fold: every faulty
            # run must then reproduce it byte for byte.
            result, store = replay(merge_ticks(items, ticks), codec=CODEC, partition=p, partitions=PARTITIONS,
                                   audit_ledger=True)
            offline[p] = (result, ledger_snapshot(store, CODEC))
            got = [CODEC.decode(v)[1] for v in outputs[("settlement-results", p, "SettlementResult")]]
            assert got == result.outputs.results, f"seed {seed}: the fault-free run's results differ from the offline fold"
            got_releases = [CODEC.decode(v)[1] for v in outputs.get(("capacity-releases", p, "CapacityReleased"), [])]
            assert got_releases == result.outputs.releases, f"seed {seed}: fault-free releases differ from the offline fold"
        ledgers = {p: ledger_snapshot(stores[p], CODEC) for p in stores}
        assert ledgers == {p: led for p, (_, led) in offline.items()}, f"seed {seed}: fault-free ledger differs"
        _references[key] = Reference(outputs, ledgers, offline)
    return _references[key]


def run_seed(seed: int, events: int = 60, streams: int = 20) -> dict:
    """One simulated run with faults; raises AssertionError naming the seed on any divergence. Runs of
    seeds that agree modulo `streams` share an input stream (and its fault-free reference)."""
    rng = random.Random(seed)
    stream_seed = seed % streams
    inputs, clock, adversity = partition_inputs(stream_seed, events)
    inputs = {p: list(values) for p, values in inputs.items()}
    ref = reference(stream_seed, events)
    plan = Plan(rng)
    for point in CRASH_POINTS:
        if rng.random() < 0.6:
            plan.crash_at[point] = {rng.randint(1, 8 if point != "mid_restore" else 3) for _ in range(rng.randint(1, 2))}
    plan.rates = {fault: rng.choice((0.0, 0.0, 0.02, 0.08)) for fault in BROKER_FAULTS}
    plan.rates.update(redeliver=rng.choice((0.0, 0.1)), crash_between_folds=rng.choice((0.0, 0.0, 0.01)),
                      delete_projection=rng.choice((0.0, 0.2)))
    where = f"seed {seed} (reproduce: python -m faults.sim --seed {seed})"
    try:
        broker, stores, incarnations = simulate(inputs, clock, plan, checkpoint_rate=rng.choice((0.05, 0.3, 1.0)))
    except AssertionError as exc:  # a check of the simulation's own (a tick missed, no progress)
        raise AssertionError(f"{where}: {exc}; faults {dict(plan.injected)}") from exc
    outputs = committed_outputs(broker)
    if set(outputs) - set(ref.outputs):
        raise AssertionError(f"{where}: committed record types the fault-free run has not: "
                             f"{sorted(set(outputs) - set(ref.outputs))}")
    for (topic, p, name), values in ref.outputs.items():
        got = outputs.get((topic, p, name), [])
        if got != values:
            raise AssertionError(f"{where}: {topic}[{p}] {name}: committed {len(got)} records, the fault-free run "
                                 f"{len(values)}; first difference at {_first_difference(got, values)}; "
                                 f"faults {dict(plan.injected)}")
    keys = [CODEC.decode(v)[1]["release_key"] for p in range(PARTITIONS)
            for v in outputs.get(("capacity-releases", p, "CapacityReleased"), [])]
    assert len(keys) == len(set(keys)), f"{where}: a release_key was committed twice"
    for p in range(PARTITIONS):
        ledger = ledger_snapshot(stores[p], CODEC) if p in stores else None
        want = ref.offline[p][1]
        if ledger is not None and ledger != want:
            raise AssertionError(f"{where}: partition {p}: the projection differs from the offline fold; "
                                 f"faults {dict(plan.injected)}")
        if changelog_ledger(broker, p) != want:
            raise AssertionError(f"{where}: partition {p}: the changelog ledger differs from the offline fold; "
                                 f"faults {dict(plan.injected)}")
    return {"incarnations": incarnations, "faults": plan.injected, "adversity": adversity}


def _first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_many(runs: int, first_seed: int = 0, events: int = 60) -> dict:
    """Many runs; stops at the first failure (its message names the seed). The processor's own logging is
    silenced meanwhile: it logs every simulated fault."""
    logging.disable(logging.CRITICAL)
    # Thousands of processors, each a reference cycle, and offline replays: left to the cyclic collector as
    # it comes (freezing survivors would keep them all until a full collection).
    saved, gc_tuning.enabled = gc_tuning.enabled, False
    try:
        return _run_many(runs, first_seed, events)
    finally:
        logging.disable(logging.NOTSET)
        gc_tuning.enabled = saved


def _run_many(runs: int, first_seed: int, events: int) -> dict:
    started = time.monotonic()
    faults: Counter = Counter()
    incarnations = 0
    for seed in range(first_seed, first_seed + runs):
        try:
            outcome = run_seed(seed, events)
        except AssertionError:
            raise
        except Exception as exc:  # the processor raised where it should have recovered
            raise AssertionError(f"seed {seed} (reproduce: python -m faults.sim --seed {seed}): "
                                 f"{type(exc).__name__}: {exc}") from exc
        faults.update(outcome["faults"])
        incarnations += outcome["incarnations"]
    return {"runs": runs, "first_seed": first_seed, "events_per_run": events, "incarnations": incarnations,
            "faults": dict(sorted(faults.items())), "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults.sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, help="run only this seed (reproduce a failure)")
    parser.add_argument("--events", type=int, default=60)
    args = parser.parse_args(argv)
    if args.seed is not None:
        logging.disable(logging.CRITICAL)
        print(run_seed(args.seed, args.events))
        return 0
    try:
        print(run_many(args.runs, args.first_seed, args.events))
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
