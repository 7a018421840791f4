"""The cross-check of the committed topics against a re-fold (`settle replay --topic`): `branch-events`, with
the processor's ticks of `ledger-ticks` merged back in at the input offsets they were folded before, is
re-folded into fresh projections (the live one is never touched) and every derived output is compared with
what the processors committed on `settlement-results`, `capacity-releases`, `settlement-audit` and
`branch-events-dlq`, and the final ledgers with the live projections when given. Each divergence names the
topic, partition and offset, and what was expected and found.

The re-fold streams: processes take partitions one at a time, the largest first (pool), and each reads a
partition's input and its four output topics through one consumer (readers), folds input records as they
arrive, and compares the outputs bytes first (diff). docs/audit.md describes the design, docs/benchmarks.md
its rates.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from branch_settlement.processors.crosscheck.diff import DERIVED, compare_live_ledger, compare_partition
from branch_settlement.processors.crosscheck.pool import process_count, run_shares
from branch_settlement.processors.crosscheck.progress import AUTO, Progress
from branch_settlement.processors.crosscheck.readers import (BATCH, GROUP_ID, IDLE_WAIT_S, READER_SETTINGS,
                                                             committed_offsets, input_bounds, know_leaders, partitions_of,
                                                             read_ticks, stable_ends)
from branch_settlement.processors.crosscheck.report import Divergence, Lag, PartitionOutcome, Report
from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.processors.kafka.ticks import TICKS_TOPIC as TICKS_SECTION
from branch_settlement.processors.ledger.outputs import DEAD_LETTER_TOPIC, OUTPUT_ROUTES, OUTPUT_TOPICS
from branch_settlement.processors.replay.replayer import Input, Replayer
from branch_settlement.projections.store import MemoryStore, Store
from branch_settlement.schemas.codec import Codec, CodecError, default_codec


def audit_replay(client_config: dict, names: dict[str, str], codec: Codec, *, partitions: list[int] | None = None,
                 offset_range: tuple[int, int] = (0, sys.maxsize), live_ledgers=None,
                 store_factory: Callable[[], Store] | None = None, progress_stream=None, jobs: int | None = None,
                 keep_folded: bool = True, group_id: str | None = None, progress_mode: str = AUTO) -> Report:
    """Re-fold the input topic and compare everything derived with what was committed.

    Partitions are independent (each its own ledger and ledger time), so `jobs` processes (default: one per
    core, at most one per partition; this process is one of them) take them one at a time, the largest
    first, until none is left. `live_ledgers`: the live ledgers per partition (`ledger_snapshot`s), or a
    `LiveProjections` that each process opens for its own partitions. `keep_folded`: return each
    partition's `ReplayResult` and store in `Report.folded` (for `--json`; other processes send them back).
    The other processes are forked when this process runs a single thread, else spawned (multiprocessing's
    spawn: a script calling this from another thread needs the usual `if __name__ == "__main__":` guard).

    `group_id`: the processors' consumer group. Its committed offsets are read before any output (so every
    output of an input below them is already readable); an output the re-fold expects for an input at or
    beyond them is not yet processed (`Report.not_yet_processed`, with the lag per partition in `Report.lag`),
    not missing. Without it every expected output must be there."""
    started = time.monotonic()
    topic = names["branch-events"]
    every_partition = partitions_of(client_config, topic)
    partitions = partitions if partitions is not None else every_partition
    bounds = input_bounds(client_config, topic, partitions)
    order = sorted(partitions, key=lambda p: (bounds[p][1] - bounds[p][0], p))  # the largest first
    report = Report(partitions=partitions, group_id=group_id)
    committed = None
    if group_id is not None:
        committed = committed_offsets(client_config, group_id, topic, partitions)
        report.lag = {p: Lag(committed[p], bounds[p][0]) for p in partitions}
    progress = Progress(sum(high - low for high, low in bounds.values()), stream=progress_stream or sys.stderr,
                        mode=progress_mode)
    ends = {p: high for p, (high, _) in bounds.items()}
    job = _Job(client_config, names, order, ends, len(every_partition), offset_range, live_ledgers, keep_folded,
               store_factory, committed)
    processes = process_count(jobs, partitions, codec, store_factory)
    by_partition = run_shares(_replay_share, job, order, processes, progress, codec)
    progress.complete()  # every input record was read (the workers' counts reach the bar only now and then)
    progress.finish()
    # divergences in the order a sequential replay reports them: topic by topic, then the ledgers
    for section in (*DERIVED, DEAD_LETTER_TOPIC, TICKS_SECTION, "ledger"):
        for p in sorted(by_partition):
            report.divergences.extend(by_partition[p].divergences.get(section, ()))
    for p in sorted(by_partition):
        report.not_yet_processed.extend(by_partition[p].not_yet_processed)
    report.events = sum(part.events for part in by_partition.values())
    report.compared = sum(part.compared for part in by_partition.values())
    if keep_folded:
        report.folded = {p: by_partition[p].folded for p in sorted(by_partition)}
    report.processes = {p: (part.process, part.cpu_s, part.done_at) for p, part in by_partition.items()}
    report.seconds = time.monotonic() - started
    return report


@dataclass
class _Job:
    client_config: dict
    names: dict[str, str]
    order: list[int]  # the partitions, in the order they are taken
    input_ends: dict[int, int]  # where each partition's input ends (when the replay began)
    partition_count: int  # of the input topic: each partition's fold folds only its own parents
    offset_range: tuple[int, int]
    live: object  # dict[int, dict] | LiveProjections | None
    keep_folded: bool
    store_factory: Callable[[], Store] | None = None
    committed: dict[int, int] | None = None  # the processors' group's committed offsets, when checked


# Partitions a process has assigned at once: while one finishes (its last outputs, the comparison), the
# broker already sends the next.
WINDOW = 2


class _Output:
    """What was read of one output topic-partition."""

    __slots__ = ("records", "end", "eof", "done")

    def __init__(self) -> None:
        self.records: list[tuple[int, bytes]] = []  # (offset, value)
        self.end: int | None = None  # where reading stops: decided once the partition's fold is done
        self.eof = -1  # the highest end-of-partition position seen before that
        self.done = False

    def take(self, message, err, name: str, p: int) -> None:
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                raise KafkaFailure(f"reading {name}[{p}]: {err.str()} ({err.name()})", code=err.name())
            if self.end is None:
                self.eof = max(self.eof, message.offset())
            else:
                self.done = True  # reached the end as read_committed sees it
            return
        offset = message.offset()
        if self.end is not None and offset >= self.end:
            self.done = True
            return
        self.records.append((offset, message.value()))
        if self.end is not None and offset >= self.end - 1:
            self.done = True

    def set_end(self, end: int) -> None:
        self.end = end
        if self.records and self.records[-1][0] >= end:
            self.records[:] = [r for r in self.records if r[0] < end]
        last = self.records[-1][0] if self.records else -1
        self.done = end == 0 or self.eof >= end or last >= end - 1


class _Active:
    """A partition being replayed: its fold, fed as input records arrive, and its outputs as read."""

    def __init__(self, p: int, job: _Job, codec: Codec, ticks: list[Input]) -> None:
        self.p = p
        self.replayer = Replayer((job.store_factory or MemoryStore)(), codec=codec, partition=p,
                                 partitions=job.partition_count)
        # The partition's ledger ticks, merged in before the inputs they were folded before; a record there that
        # is no tick of the processor's is a divergence of its own, never folded.
        self.ticks = [tick for tick in ticks if tick.event is not None]
        self.bad_ticks = [Divergence(job.names[TICKS_SECTION], p, None, tick.offset if tick.offset >= 0 else None, "extra", None,
                                     {"reason": tick.reason}) for tick in ticks if tick.event is None]
        self.next_tick = 0
        self.input_end = 0
        self.inputs_done = False
        self.outputs = {t: _Output() for t in OUTPUT_TOPICS}
        self.outputs_left = len(OUTPUT_TOPICS)
        # What the fold derives, encoded as each event is folded (its ids and numbers are then in the codec's
        # caches), per output topic in the processor's order; the records themselves only for --json.
        self.derived: dict[str, list[bytes]] = {topic: [] for topic in DERIVED}
        self._keep = job.keep_folded
        self._routes = [(attr, self.derived[topic], codec.encoder(name)) for attr, topic, name in OUTPUT_ROUTES]
        self._kept = {attr: 0 for attr, _, _ in OUTPUT_ROUTES}

    def feed_ticks(self, before: int) -> None:
        """Fold the ledger ticks anchored at or before input offset `before` (processors/kafka/ticks.py)."""
        ticks = self.ticks
        while self.next_tick < len(ticks) and ticks[self.next_tick].offset <= before:
            self.feed(ticks[self.next_tick])
            self.next_tick += 1

    def feed(self, item: Input) -> None:
        self.replayer.feed(item)
        out = self.replayer.result.outputs
        kept = self._kept
        for attr, derived, encode in self._routes:
            records = getattr(out, attr)
            if len(records) > kept[attr]:
                derived.extend(map(encode, records[kept[attr]:]))
                if self._keep:
                    kept[attr] = len(records)
                else:
                    records.clear()


def _replay_share(job: _Job, claim: Callable[[], int | None], progress, codec: Codec | None = None
                  ) -> dict[int, PartitionOutcome]:
    """Replay the partitions `claim` gives, each with its four output topics, through one consumer: every
    input record is folded as it arrives; the output topics are assigned at the same time (from the
    beginning), so the broker sends them while the inputs are folded, but where they end is decided only
    once the partition's fold is done (their last stable offsets then), as when they were read after it."""
    codec = codec or default_codec()
    names = job.names
    topic = names["branch-events"]
    logical = {names[t]: t for t in OUTPUT_TOPICS}
    decode_event = codec.decode_event
    consumer = Consumer({**job.client_config, "group.id": GROUP_ID, **READER_SETTINGS})
    know_leaders(consumer, [topic, *logical])
    admin = AdminClient(job.client_config)
    active: dict[int, _Active] = {}
    parts: dict[int, PartitionOutcome] = {}
    folded_since_progress = 0

    def take_next() -> bool:
        p = claim()
        if p is None:
            return False
        part = active[p] = _Active(p, job, codec, read_ticks(job.client_config, names[TICKS_SECTION], [p], codec)[p])
        part.input_end = job.input_ends[p]
        consumer.incremental_assign(([TopicPartition(topic, p, OFFSET_BEGINNING)] if part.input_end > 0 else []) +
                                    [TopicPartition(names[t], p, OFFSET_BEGINNING) for t in OUTPUT_TOPICS])
        if part.input_end == 0:
            inputs_done(part)
        return True

    def inputs_done(part: _Active) -> None:
        part.feed_ticks(part.input_end)  # the ticks made after the last input the replay folds
        part.inputs_done = True
        if part.input_end > 0:
            consumer.incremental_unassign([TopicPartition(topic, part.p)])
        for t, end in stable_ends(admin, [names[t] for t in OUTPUT_TOPICS], part.p).items():
            part.outputs[logical[t]].set_end(end)
        part.outputs_left = sum(1 for out in part.outputs.values() if not out.done)

    try:
        while len(active) < WINDOW and take_next():
            pass
        while active:
            for message in consumer.consume(num_messages=BATCH, timeout=IDLE_WAIT_S):
                name = message.topic()
                p = message.partition()
                part = active.get(p)
                if part is None:
                    continue  # fetched before its partition was finished and unassigned
                err = message.error()
                if name == topic:
                    if part.inputs_done:
                        continue
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            inputs_done(part)
                            continue
                        raise KafkaFailure(f"reading {topic}[{p}]: {err.str()} ({err.name()})", code=err.name())
                    offset = message.offset()
                    if offset >= part.input_end:
                        inputs_done(part)
                        continue
                    value = message.value()
                    try:
                        item = Input(offset, decode_event(value or b""))
                    except CodecError as exc:
                        item = Input(offset, None, str(exc))
                    part.feed_ticks(offset)
                    part.feed(item)
                    folded_since_progress += 1
                    if folded_since_progress == 1000:
                        progress(1000)
                        folded_since_progress = 0
                    if offset >= part.input_end - 1:
                        inputs_done(part)
                    continue
                out = part.outputs[logical[name]]
                if out.done:
                    continue
                if err is None and out.end is None:
                    out.records.append((message.offset(), message.value()))
                    continue
                out.take(message, err, name, p)
                if out.done:
                    part.outputs_left -= 1
            for part in [part for part in active.values() if part.inputs_done and part.outputs_left == 0]:
                consumer.incremental_unassign([TopicPartition(names[t], part.p) for t in OUTPUT_TOPICS])
                del active[part.p]
                take_next()
                parts[part.p] = _finish(part, job, codec)
        progress(folded_since_progress)
    except KafkaException as exc:
        raise KafkaFailure.wrap("reading the topics", exc) from None
    finally:
        consumer.close()
    return parts


def _finish(part: _Active, job: _Job, codec: Codec) -> PartitionOutcome:
    p = part.p
    result, store = part.replayer.finish(write_store=job.live is not None or job.keep_folded)
    done = PartitionOutcome(events=len(result.dead_letters) + result.events)
    published = {t: out.records for t, out in part.outputs.items()}
    compare_partition(p, part.derived, result.dead_letters, published, codec, job.offset_range, job.names, done,
                      snapshot_end=part.input_end, committed=None if job.committed is None else job.committed[p])
    if part.bad_ticks:
        done.divergences[TICKS_SECTION] = part.bad_ticks
    if job.live is not None:
        compare_live_ledger(p, store, job.live, codec, done)
    if job.keep_folded:
        done.folded = (result, store)
    done.process, done.cpu_s, done.done_at = os.getpid(), time.process_time(), time.time()
    return done
