"""Audit replay against the topics: re-fold `branch-events` into fresh projections (the live one is never
touched) and compare every derived output with what the processors committed on `settlement-results`,
`capacity-releases`, `settlement-audit` and `branch-events-dlq`, and the final ledgers with the live
projections when given. Each divergence names the topic, partition and offset, and what was expected and
found.

Outputs are matched by what produced them, not by their position: (input offset, record kind, n-th of that
kind for that input). So an injected record, a removed one and an altered one are each reported once, at
their own offset, instead of shifting every record after them.

How it is fast (issue 5: at least twice the live processor's rate). Partitions are independent, so one
process per core takes them one at a time, the largest first. Each process reads a partition's input and its
four output topics through one consumer, folds input records as they arrive, and first compares each output
topic-partition as bytes: the published values against the derived records encoded the same way, each kind
in its order. Only a topic-partition where the bytes differ (a divergence, a processor ahead of the input
read, another writer schema) is decoded and matched record by record as above, which pinpoints each
divergence; so decoding is paid only where something differs. The final ledger is compared with the live
projection the same way: equal record bytes agree, the others are compared as `ledger_snapshot` shows them.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.processors.kafka.partition import store_path
from branch_settlement.processors.ledger.outputs import DEAD_LETTER_TOPIC, OUTPUT_ROUTES, OUTPUT_TOPICS
from branch_settlement.processors.replay.partitioned import (decode_record, gather_workers, send_outcome, start_workers,
                                                             stop_workers)
from branch_settlement.processors.replay.replayer import (Input, Replayer, ReplayResult, child_entry, ledger_snapshot,
                                                          parent_entry)
from branch_settlement.projections import keys
from branch_settlement.projections.store import MemoryStore, RocksStore, Store
from branch_settlement.schemas.codec import HEADER_SIZE, Codec, CodecError, default_codec

# Output topic -> ((record name, the Outputs list it is derived from), ...), from the one routing table.
DERIVED = {topic: tuple((name, attr) for attr, routed, name in OUTPUT_ROUTES if routed == topic)
           for topic in dict.fromkeys(topic for _, topic, _ in OUTPUT_ROUTES)}


@dataclass
class Divergence:
    topic: str
    partition: int
    offset: int | None  # of the published record; None when it is missing
    input_offset: int | None
    problem: str  # missing | extra | different | ledger
    expected: object = None
    found: object = None

    def describe(self) -> str:
        where = f"{self.topic}[{self.partition}]" + (f"@{self.offset}" if self.offset is not None else "")
        cause = f" (input offset {self.input_offset})" if self.input_offset is not None else ""
        return f"{self.problem:<9} {where}{cause}\n    expected: {self.expected}\n    found:    {self.found}"


@dataclass
class Report:
    events: int = 0
    partitions: list[int] = field(default_factory=list)
    compared: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    folded: dict = field(default_factory=dict)
    seconds: float = 0.0
    processes: dict = field(default_factory=dict)  # partition -> (pid, its CPU seconds, wall time) when done

    @property
    def agrees(self) -> bool:
        return not self.divergences


class Progress:
    """A progress bar with rate and ETA on a terminal; a plain line every few seconds otherwise."""

    def __init__(self, total: int, stream=sys.stderr, every_s: float = 5.0) -> None:
        self.total, self.stream, self.every_s = max(total, 1), stream, every_s
        self.done = 0
        self.started = self.last = time.monotonic()
        self.tty = stream.isatty()

    def __call__(self, n: int) -> None:
        self.update(self.done + n)

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if not self.tty and now - self.last < self.every_s:
            return
        self.last = now
        rate = self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0
        if self.tty:
            filled = int(30 * min(self.done / self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {self.done:,}/{self.total:,} events "
                              f"{rate:,.0f}/s ETA {eta:,.0f} s ")
        else:
            self.stream.write(f"replayed {self.done:,}/{self.total:,} events, {rate:,.0f}/s, ETA {eta:,.0f} s\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")


# A reader of whole topics: large fetches, and a short wait whenever the fetched records run out, since
# consume(n, timeout) waits out its timeout on every batch of fewer than n records.
READER_SETTINGS = {"enable.auto.commit": False, "isolation.level": "read_committed", "enable.partition.eof": True,
                   "fetch.wait.max.ms": 10, "max.partition.fetch.bytes": 8 << 20, "fetch.max.bytes": 64 << 20}
BATCH = 10_000
IDLE_WAIT_S = 0.05
GROUP_ID = "settle-audit-replay"


def read_committed(client_config: dict, topic: str, partitions: Iterable[int], start: dict[int, int] | None = None,
                   end: dict[int, int] | None = None) -> dict[int, list]:
    """Committed records of `topic` per partition: (offset, key, value), from `start` (default: the
    beginning) up to the end offsets `end` (default: the ends when reading began)."""
    consumer = Consumer({**client_config, "group.id": GROUP_ID, **READER_SETTINGS})
    try:
        partitions = list(partitions)
        if end is None:
            end = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        start = start or {}
        records: dict[int, list] = {p: [] for p in partitions}
        pending = {p for p in partitions if start.get(p, 0) < end[p]}
        if not pending:
            return records
        consumer.assign([TopicPartition(topic, p, start.get(p, -2)) for p in pending])
        while pending:
            for message in consumer.consume(num_messages=BATCH, timeout=IDLE_WAIT_S):
                p = message.partition()
                err = message.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(p)
                        continue
                    raise KafkaFailure(f"reading {topic}[{p}]: {err.str()} ({err.name()})", code=err.name())
                if message.offset() >= end[p]:
                    pending.discard(p)
                    continue
                records[p].append((message.offset(), message.key(), message.value()))
                if message.offset() >= end[p] - 1:
                    pending.discard(p)
        return records
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"reading {topic}", exc) from None
    finally:
        consumer.close()


def know_leaders(consumer: Consumer, topics: list[str]) -> None:
    """Fetch the topics' metadata before assigning partitions at a logical offset (the beginning): assigned
    before its leader is known, a partition's offset query is retried only after 500 ms (librdkafka 2.16,
    "no current leader for partition: (re)starting offset query timer"), half a second lost by each reader."""
    for topic in topics:
        consumer.list_topics(topic, timeout=10)


def partitions_of(client_config: dict, topic: str) -> list[int]:
    consumer = Consumer({**client_config, "group.id": GROUP_ID})
    try:
        metadata = consumer.list_topics(topic, timeout=10)
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"metadata of {topic}", exc) from None
    finally:
        consumer.close()
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        raise KafkaFailure(f"topic {topic} does not exist")
    return sorted(found.partitions)


def offsets_for_time(client_config: dict, topic: str, partitions: list[int], time_ms: int) -> dict[int, int]:
    consumer = Consumer({**client_config, "group.id": GROUP_ID})
    try:
        found = consumer.offsets_for_times([TopicPartition(topic, p, time_ms) for p in partitions], timeout=10)
    finally:
        consumer.close()
    ends = {}
    for tp in found:
        ends[tp.partition] = tp.offset if tp.offset >= 0 else sys.maxsize
    return ends


def read_inputs(client_config: dict, topic: str, partitions: list[int], codec: Codec) -> dict[int, list]:
    """The input topic as the processor saw it: per partition, (Input, raw bytes) in offset order."""
    raw = read_committed(client_config, topic, partitions)
    return {p: [decode_record(codec, p, offset, value)[1:] for offset, _, value in recs] for p, recs in raw.items()}


def _keyed_published(rows: list[tuple[int, str, dict]]) -> dict[tuple, tuple[int, dict]]:
    keyed = {}
    counts: dict[tuple, int] = {}
    for offset, kind, record in rows:
        base = (kind, record["input_offset"])
        n = counts.get(base, 0)
        counts[base] = n + 1
        keyed[(kind, record["input_offset"], n)] = (offset, record)
    return keyed


def _diff(topic: str, partition: int, expected: dict, found: dict, low: int, high: int, report: Report) -> None:
    last_replayed = max((key[1] for key in expected), default=-1)
    for key in sorted(set(expected) | set(found), key=lambda k: (k[1], k[0], k[2])):
        input_offset = key[1]
        if not low <= input_offset <= high:
            continue
        if key not in found:
            report.divergences.append(Divergence(topic, partition, None, input_offset, "missing", expected[key], None))
        elif key not in expected:
            if input_offset > last_replayed and key[0] != "DeadLetter":
                continue  # the processor is ahead of the replay's snapshot of the input
            report.divergences.append(Divergence(topic, partition, found[key][0], input_offset, "extra", None,
                                                 found[key][1]))
        else:
            report.compared += 1
            if found[key][1] != expected[key]:
                report.divergences.append(Divergence(topic, partition, found[key][0], input_offset, "different",
                                                     _changed(expected[key], found[key][1]),
                                                     _changed(found[key][1], expected[key])))


def _changed(a: dict, b: dict) -> dict:
    """The fields of `a` that differ from `b`: a readable divergence, not two whole records."""
    return {k: v for k, v in a.items() if b.get(k) != v} if isinstance(a, dict) and isinstance(b, dict) else a


def compare_ledgers(folded: dict[int, tuple[ReplayResult, Store]], live: dict[int, dict], codec: Codec,
                    report: Report) -> None:
    for p, (_, store) in folded.items():
        if p not in live:
            continue
        derived = ledger_snapshot(store, codec)
        for section in ("parents", "children"):
            for key in sorted(set(derived[section]) | set(live[p][section])):
                if derived[section].get(key) != live[p][section].get(key):
                    report.divergences.append(Divergence(f"projection/{section}", p, None, None, "ledger",
                                                         {key: derived[section].get(key)},
                                                         {key: live[p][section].get(key)}))


# -- the audit replay, partition by partition -------------------------------------------------------------

def audit_replay(client_config: dict, names: dict[str, str], codec: Codec, *, partitions: list[int] | None = None,
                 offset_range: tuple[int, int] = (0, sys.maxsize), live_ledgers=None,
                 store_factory: Callable[[], Store] | None = None, progress_stream=None, jobs: int | None = None,
                 keep_folded: bool = True) -> Report:
    """Re-fold the input topic and compare everything derived with what was committed.

    Partitions are independent (each its own ledger and ledger time), so `jobs` processes (default: one per
    core, at most one per partition; this process is one of them) take them one at a time, the largest
    first, until none is left. `live_ledgers`: the live ledgers per partition (`ledger_snapshot`s), or a
    `LiveProjections` that each process opens for its own partitions. `keep_folded`: return each
    partition's `ReplayResult` and store in `Report.folded` (for `--json`; other processes send them back).
    The other processes are forked when this process runs a single thread, else spawned (multiprocessing's
    spawn: a script calling this from another thread needs the usual `if __name__ == "__main__":` guard)."""
    started = time.monotonic()
    topic = names["branch-events"]
    partitions = partitions if partitions is not None else partitions_of(client_config, topic)
    bounds = input_bounds(client_config, topic, partitions)
    order = sorted(partitions, key=lambda p: (bounds[p][1] - bounds[p][0], p))  # the largest first
    report = Report(partitions=partitions)
    progress = Progress(sum(high - low for high, low in bounds.values()), stream=progress_stream or sys.stderr)
    ends = {p: high for p, (high, _) in bounds.items()}
    job = _Job(client_config, names, order, ends, offset_range, live_ledgers, keep_folded, store_factory)
    by_partition = _run_jobs(job, _jobs(jobs, partitions, codec, store_factory), progress, codec)
    progress.finish()
    # divergences in the order a sequential replay reports them: topic by topic, then the ledgers
    for section in (*DERIVED, DEAD_LETTER_TOPIC, "ledger"):
        for p in sorted(by_partition):
            report.divergences.extend(by_partition[p].divergences.get(section, ()))
    report.events = sum(part.events for part in by_partition.values())
    report.compared = sum(part.compared for part in by_partition.values())
    if keep_folded:
        report.folded = {p: by_partition[p].folded for p in sorted(by_partition)}
    report.processes = {p: (part.process, part.cpu_s, part.done_at) for p, part in by_partition.items()}
    report.seconds = time.monotonic() - started
    return report


def input_bounds(client_config: dict, topic: str, partitions: list[int]) -> dict[int, tuple[int, int]]:
    """(end, beginning) of each partition of the input when reading begins; the end is the last stable
    offset (read_committed), where the replay of that partition stops."""
    consumer = Consumer({**client_config, "group.id": GROUP_ID, **READER_SETTINGS})
    try:
        bounds = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            bounds[p] = (high, min(low, high))
        return bounds
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"offsets of {topic}", exc) from None
    finally:
        consumer.close()


def _jobs(jobs: int | None, partitions: list[int], codec: Codec, store_factory) -> int:
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:
            jobs = os.cpu_count() or 1
    if codec is not default_codec() or store_factory not in (None, MemoryStore):
        return 1  # the other processes build their own default codec and in-memory stores
    return max(1, min(jobs, len(partitions)))


@dataclass
class LiveProjections:
    """The live projections of a processor's state directory (kafka/partition.py's layout), opened
    read-only by whichever process replays partition N."""

    state_dir: str
    group_id: str

    def open(self, partition: int) -> Store | None:
        path = store_path(self.state_dir, self.group_id, partition)
        return RocksStore(path, read_only=True) if path.exists() else None


@dataclass
class _Job:
    client_config: dict
    names: dict[str, str]
    order: list[int]  # the partitions, in the order they are taken
    input_ends: dict[int, int]  # where each partition's input ends (when the replay began)
    offset_range: tuple[int, int]
    live: object  # dict[int, dict] | LiveProjections | None
    keep_folded: bool
    store_factory: Callable[[], Store] | None = None


@dataclass
class _Partition:
    """One partition's replay and comparison."""

    events: int = 0
    compared: int = 0
    divergences: dict[str, list[Divergence]] = field(default_factory=dict)  # section -> divergences
    folded: tuple[ReplayResult, Store] | None = None
    process: int = 0  # pid of the process that replayed it
    cpu_s: float = 0.0  # that process's CPU time when it was done
    done_at: float = 0.0  # wall-clock time when it was done


def _run_jobs(job: _Job, jobs: int, progress: Progress, codec: Codec) -> dict[int, _Partition]:
    """This process and `jobs - 1` fresh ones take partitions from `job.order` until none is left."""
    if jobs == 1:
        taken = iter(job.order)
        return _replay_share(job, lambda: next(taken, None), progress, codec)
    ctx = _start_method()
    next_index = ctx.Value("i", 0)  # with its lock: the index in job.order of the next partition to take
    counter = ctx.Value("q", 0, lock=False)  # events folded by the other processes, for the progress bar
    workers = []
    try:
        start_workers(workers, ctx, _worker, [(job, next_index, counter)] * (jobs - 1))
        own_done = 0

        def own_progress(n: int) -> None:
            nonlocal own_done
            own_done += n
            progress.update(own_done + counter.value)

        results = _replay_share(job, _claimer(job.order, next_index), own_progress, codec)
        gather_workers(workers, results, KafkaFailure)
        return results
    finally:
        stop_workers(workers)


def _start_method():
    """fork when this process runs a single thread (nothing to import again, the codec already built), else
    spawn: a fork of a process holding librdkafka's (or any other) threads may inherit a lock held by one."""
    import multiprocessing

    try:
        single = len(os.listdir("/proc/self/task")) == 1
    except OSError:
        single = False
    return multiprocessing.get_context("fork" if single else "spawn")


def _claimer(order: list[int], next_index) -> Callable[[], int | None]:
    def claim() -> int | None:
        with next_index.get_lock():
            i = next_index.value
            if i >= len(order):
                return None
            next_index.value = i + 1
        return order[i]
    return claim


def _worker(job: _Job, next_index, counter, send) -> None:
    def progress(n: int) -> None:
        counter.value += n  # one writer per 1000 events each; a lost update only slows the bar

    send_outcome(send, lambda: _replay_share(job, _claimer(job.order, next_index), progress))


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

    def __init__(self, p: int, job: _Job, codec: Codec) -> None:
        self.p = p
        self.replayer = Replayer((job.store_factory or MemoryStore)(), codec=codec, partition=p)
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
                  ) -> dict[int, _Partition]:
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
    parts: dict[int, _Partition] = {}
    folded_since_progress = 0

    def take_next() -> bool:
        p = claim()
        if p is None:
            return False
        part = active[p] = _Active(p, job, codec)
        part.input_end = job.input_ends[p]
        consumer.incremental_assign(([TopicPartition(topic, p, OFFSET_BEGINNING)] if part.input_end > 0 else []) +
                                    [TopicPartition(names[t], p, OFFSET_BEGINNING) for t in OUTPUT_TOPICS])
        if part.input_end == 0:
            inputs_done(part)
        return True

    def inputs_done(part: _Active) -> None:
        part.inputs_done = True
        if part.input_end > 0:
            consumer.incremental_unassign([TopicPartition(topic, part.p)])
        for t, end in _stable_ends(admin, [names[t] for t in OUTPUT_TOPICS], part.p).items():
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


def _finish(part: _Active, job: _Job, codec: Codec) -> _Partition:
    p = part.p
    result, store = part.replayer.finish(write_store=job.live is not None or job.keep_folded)
    done = _Partition(events=len(result.dead_letters) + result.events)
    published = {t: out.records for t, out in part.outputs.items()}
    _compare_partition(p, part.derived, result.dead_letters, published, codec, job.offset_range, job.names, done)
    if job.live is not None:
        _compare_ledger(p, store, job.live, codec, done)
    if job.keep_folded:
        done.folded = (result, store)
    done.process, done.cpu_s, done.done_at = os.getpid(), time.process_time(), time.time()
    return done


def encode_derived(outputs, codec: Codec) -> dict[str, list[bytes]]:
    """The derived outputs encoded per output topic, in the processor's order (what `_Active.feed` builds as
    it folds)."""
    derived: dict[str, list[bytes]] = {topic: [] for topic in DERIVED}
    for attr, topic, name in OUTPUT_ROUTES:
        derived[topic].extend(codec.encode(name, record) for record in getattr(outputs, attr))
    return derived


def _compare_partition(p: int, derived: dict[str, list[bytes]], dead_letters: list[dict], published: dict,
                       codec: Codec, offset_range: tuple[int, int], names: dict[str, str], part: _Partition) -> None:
    """The derived outputs of one partition (encoded) against the published ones. Published records are
    compared as bytes with the derived ones, in order; only a topic-partition where they differ is decoded and
    matched record by record (`_diff`), which pinpoints each divergence."""
    low, high = offset_range
    full = low <= 0 and high >= sys.maxsize
    for topic in DERIVED:
        mine = derived[topic]
        rows = published[topic]
        report = Report()
        if _same_bytes(mine, rows):
            report.compared = len(mine) if full else sum(
                1 for value in mine if low <= codec.decode(value)[1]["input_offset"] <= high)
        else:
            expected = {key: record for key, (_, record) in _keyed_published(
                [(None, *codec.decode(value)) for value in mine]).items()}
            decoded = [(offset, *codec.decode(value)) for offset, value in rows]
            _diff(names[topic], p, expected, _keyed_published(decoded), low, high, report)
        part.compared += report.compared
        part.divergences[topic] = report.divergences
    report = Report()
    expected = {("DeadLetter", letter["offset"], 0): {"offset": letter["offset"], "reason": letter["reason"]}
                for letter in dead_letters}
    found = {}
    for offset, value in published["branch-events-dlq"]:
        letter = codec.decode(value)[1]
        found[("DeadLetter", letter["offset"], 0)] = (offset, {"offset": letter["offset"], "reason": letter["reason"]})
    _diff(names["branch-events-dlq"], p, expected, found, low, high, report)
    part.compared += report.compared
    part.divergences["branch-events-dlq"] = report.divergences


def _same_bytes(derived: list[bytes], rows: list[tuple[int, bytes]]) -> bool:
    """Whether the published values are exactly the derived records: in the same order, or with their kinds
    interleaved otherwise but each kind in its order (a processor that wrote each checkpoint's kinds apart; a
    kind's schema fingerprint heads its bytes, so no record of one kind equals one of another)."""
    if len(derived) != len(rows):
        return False
    values = [value for _, value in rows]
    if values == derived:
        return True
    by_kind: dict[bytes, list[bytes]] = {}
    for value in derived:
        by_kind.setdefault(value[:HEADER_SIZE], []).append(value)
    position = dict.fromkeys(by_kind, 0)
    for value in values:
        kind = value[:HEADER_SIZE]
        records = by_kind.get(kind)
        if records is None or position[kind] == len(records) or records[position[kind]] != value:
            return False
        position[kind] += 1
    return True


def _stable_ends(admin: AdminClient, topics: list[str], partition: int) -> dict[str, int]:
    """The last stable offset of `partition` of each topic (read_committed), in one request."""
    request = {TopicPartition(topic, partition): OffsetSpec.latest() for topic in topics}
    futures = admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=10)
    try:
        return {tp.topic: future.result().offset for tp, future in futures.items()}
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"end offsets of partition {partition}", exc) from None


def _compare_ledger(p: int, store: Store, live, codec: Codec, part: _Partition) -> None:
    """The final ledger against the live projection's: records whose bytes are equal agree; the others are
    compared as `ledger_snapshot` shows them."""
    divergences = part.divergences.setdefault("ledger", [])
    if isinstance(live, dict):
        if p in live:
            report = Report()
            compare_ledgers({p: (None, store)}, {p: live[p]}, codec, report)
            divergences.extend(report.divergences)
        return
    live_store = live.open(p)
    if live_store is None:
        return
    try:
        for section, kind, entry in (("parents", keys.PARENT, parent_entry), ("children", keys.CHILD, child_entry)):
            derived = dict(store.scan(keys.prefix(kind)))
            found = dict(live_store.scan(keys.prefix(kind)))
            differ = []
            for key in derived.keys() | found.keys():
                a, b = derived.get(key), found.get(key)
                if a == b:
                    continue
                mine = entry(codec.decode(a)[1]) if a is not None else None
                theirs = entry(codec.decode(b)[1]) if b is not None else None
                name = (mine or theirs)[0]
                if (mine and mine[1]) != (theirs and theirs[1]):
                    differ.append((name, mine[1] if mine else None, theirs[1] if theirs else None))
            for name, mine, theirs in sorted(differ, key=lambda d: d[0]):
                divergences.append(Divergence(f"projection/{section}", p, None, None, "ledger", {name: mine},
                                              {name: theirs}))
    finally:
        live_store.close()


__all__ = ["audit_replay", "Report", "Divergence", "LiveProjections", "read_inputs", "read_committed",
           "partitions_of", "offsets_for_time", "Input"]
