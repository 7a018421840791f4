"""`settle run`'s loop in one process, without a broker: where the processor's own CPU goes. Not a test: it reports.

    .venv/bin/python bench/loop.py [--events 200000] [--seed 7] [--repeat 3] [--split]

The real `Processor` (its `step`: the compiled message loop, the early produce, every checkpoint with its ledger
changes, gauges, RocksDB batches and collector policy) folds the seeded realistic workload over 8 partitions, each
into its own RocksDB projection in a temporary directory, with exactly-once defaults (a checkpoint every 2,000
events or 100 ms). Only the clients are the fault simulation's (faults/sim.py): a consumer handing out each
partition's messages in turns, and a producer that counts the records instead of sending them. So the figure is
the processor's main thread without librdkafka: what a change to the fold, the checkpoint or the store moves, in
CPU microseconds per input record (thread time: what other processes on a shared machine move least), the
lowest of `--repeat` runs, with the cyclic collector's share (gc.callbacks). `--split` adds the thread time of
the loop's and the checkpoint's steps (the functions named in STEPS), per input record, summed over the runs; they
nest (a checkpoint that a full partition calls from within the consumed batch counts in both).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka import TopicPartition  # noqa: E402

import faults.sim as sim  # noqa: E402
from bench.suite import backlog  # noqa: E402
from branch_settlement.processors.kafka import assignment, checkpoint, reporting  # noqa: E402
from branch_settlement.processors.kafka.config import ProcessorConfig  # noqa: E402
from branch_settlement.processors.kafka.metrics import Metrics  # noqa: E402
from branch_settlement.processors.kafka.partition import PartitionTask  # noqa: E402
from branch_settlement.processors.kafka.processor import Processor  # noqa: E402
from branch_settlement.projections.store import RocksStore  # noqa: E402
from branch_settlement.projections.view import LedgerView  # noqa: E402
from branch_settlement.schemas import native  # noqa: E402
from branch_settlement.schemas.partitioning import partition_of  # noqa: E402

PARTITIONS = 8
# (owner, function) whose thread time --split reports
STEPS = ((Processor, "_fold_batch"), (Processor, "checkpoint"), (checkpoint, "encode_checkpoint"),
         (PartitionTask, "forget_committed"), (LedgerView, "mark_committed"), (PartitionTask, "_clear"),
         (PartitionTask, "write_committed"), (reporting.LedgerStats, "apply"),
         (reporting.LedgerStats, "count_audits"), (PartitionTask, "_update_capacity"), (RocksStore, "write"))


class CountingProducer(sim.FakeProducer):
    """The simulation's transactional producer, keeping no records: it counts them per topic."""

    def __init__(self, broker: sim.Broker, plan: sim.Plan, counts: Counter) -> None:
        super().__init__(broker, plan)
        self.counts = counts

    def produce(self, topic, value=None, key=None, partition=None, on_delivery=None) -> None:
        self.counts[topic] += 1
        if on_delivery is not None:
            self.deliveries.append((on_delivery, sim.Message(topic, partition, self.counts[topic], key, value)))


class TurnsConsumer(sim.FakeConsumer):
    """Up to `num_messages` per call, an equal share from each partition, as a fetch from one broker gives."""

    def consume(self, num_messages: int = 500, timeout: float = 0) -> list:
        out = []
        share = max(num_messages // len(self.position), 1)
        for p in sorted(self.position):
            start = self.position[p]
            values = self.broker.inputs[p][start:start + share]
            out += [sim.Message("branch-events", p, start + i, None, v) for i, v in enumerate(values)]
            self.position[p] = start + len(values)
        return out


def inputs_of(seed: int, events: int) -> dict[int, list[bytes]]:
    inputs: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    for record in backlog.realistic(seed, events, PARTITIONS):
        p = record.partition if record.partition is not None else partition_of(record.key.decode(), PARTITIONS)
        inputs[p].append(record.value)
    return inputs


def run(inputs: dict[int, list[bytes]], state_dir: str, counts: Counter) -> tuple[float, float]:
    """(main-thread CPU seconds, wall seconds) of one run from empty projections to the last commit."""
    broker = sim.Broker(inputs, {p: [] for p in inputs})
    plan = sim.Plan(random.Random(0))  # no faults: every rate is zero
    stores: dict[int, RocksStore] = {}
    config = ProcessorConfig(bootstrap_servers="sim:0", worker_slot="loop", tick_interval_ms=0)
    with sim.patched(plan, broker, stores):  # type: ignore[arg-type]
        assignment.open_store = lambda _dir, _group, p: stores.setdefault(p, RocksStore(os.path.join(state_dir,
                                                                                                         str(p))))
        processor = Processor(config, sim.TOPICS, sim.CODEC, Metrics())
        processor._new_producer = lambda: CountingProducer(broker, plan, counts)
        processor._partition_count = lambda consumer: len(inputs)
        processor.producer = processor._new_producer()
        processor.consumer = consumer = TurnsConsumer(broker, plan)
        processor._on_assign(consumer, [TopicPartition("branch-events", p) for p in inputs])
        cpu, wall = time.thread_time(), time.perf_counter()
        while not consumer.done():
            processor.step()
        processor.checkpoint()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    if any(broker.group_offsets.get(p, 0) != len(inputs[p]) for p in inputs):
        raise RuntimeError(f"not every input committed: {broker.group_offsets}")
    for store in stores.values():
        store.close()
    return cpu, wall


def timed(owner, name: str, totals: Counter) -> None:
    function = getattr(owner, name)
    label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] += time.thread_time() - started
    setattr(owner, name, wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000, help="generator events (default 200,000)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3, help="runs; the lowest CPU is reported (default 3)")
    parser.add_argument("--split", action="store_true", help="also the thread time of each step in STEPS")
    args = parser.parse_args()
    inputs = inputs_of(args.seed, args.events)
    records = sum(len(values) for values in inputs.values())
    steps: Counter = Counter()
    if args.split:
        for owner, name in STEPS:
            timed(owner, name, steps)
    collector = {"seconds": 0.0, "collections": 0, "started": 0.0}

    def on_collection(phase: str, _info: dict) -> None:
        if phase == "start":
            collector["started"] = time.thread_time()
        else:
            collector["seconds"] += time.thread_time() - collector["started"]
            collector["collections"] += 1
    gc.callbacks.append(on_collection)
    counts: Counter = Counter()
    runs = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="bench-loop-") as state_dir:
            runs.append(run(inputs, state_dir, counts))
    gc.callbacks.remove(on_collection)
    per = 1e6 / (records * args.repeat)
    best = min(runs)
    print(f"{records:,} input records, {native.describe(native.select())}, {args.repeat} runs")
    print(f"main thread: {best[0] * 1e6 / records:.2f} CPU µs per input record (lowest; all: "
          f"{', '.join(f'{cpu * 1e6 / records:.2f}' for cpu, _ in runs)}), {records / best[1]:,.0f} records/s")
    print(f"cyclic collector: {collector['seconds'] * per:.2f} µs per input record, "
          f"{collector['collections'] / args.repeat:.0f} collections per run")
    print("records produced per input record: " + ", ".join(
        f"{topic} {n / (records * args.repeat):.2f}" for topic, n in counts.most_common()))
    for label, seconds in steps.most_common():
        print(f"  {label:<45} {seconds * per:6.2f} µs per input record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
