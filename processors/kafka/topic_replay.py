"""Audit replay against the topics: re-fold `branch-events` into fresh projections (the live one is never
touched) and compare every derived output with what the processors committed on `settlement-results`,
`capacity-releases`, `settlement-audit` and `branch-events-dlq`, and the final ledgers with the live
projections when given. Each divergence names the topic, partition and offset, and what was expected and
found.

Outputs are matched by what produced them, not by their position: (input offset, record kind, n-th of that
kind for that input). So an injected record, a removed one and an altered one are each reported once, at
their own offset, instead of shifting every record after them.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from processors.kafka.errors import KafkaFailure
from processors.partitioned import decode_record, replay_partitions
from processors.replay import Input, Replayer, ReplayResult, child_entry, ledger_snapshot, parent_entry
from projections import keys
from projections.store import MemoryStore, RocksStore, Store
from schemas.codec import Codec, CodecError, default_codec

OUTPUT_TOPICS = ("settlement-results", "capacity-releases", "settlement-audit", "branch-events-dlq")
DERIVED = {  # output topic -> (kind, the Outputs list it is derived from)
    "settlement-results": (("SettlementResult", "results"),),
    "capacity-releases": (("CapacityReleased", "releases"), ("ParentSettled", "settled")),
    "settlement-audit": (("AuditRecord", "audits"),),
}


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


def compare(folded: dict[int, tuple[ReplayResult, Store]], published: dict[str, dict[int, list]], codec: Codec,
            offset_range: tuple[int, int], report: Report, names: dict[str, str]) -> None:
    """Derived outputs against the published ones; divergences name the physical topics."""
    low, high = offset_range
    for topic, routes in DERIVED.items():
        for p, (result, _) in folded.items():
            expected = {}
            for kind, attr in routes:
                for key, record in _keyed(kind, getattr(result.outputs, attr)):
                    expected[key] = record
            rows = [(offset, *codec.decode(value)) for offset, _, value in published[topic].get(p, [])]
            _diff(names[topic], p, expected, _keyed_published(rows), low, high, report)
    for p, (result, _) in folded.items():
        expected = {("DeadLetter", letter["offset"], 0): {"offset": letter["offset"], "reason": letter["reason"]}
                    for letter in result.dead_letters}
        found = {}
        for offset, _, value in published["branch-events-dlq"].get(p, []):
            letter = codec.decode(value)[1]
            found[("DeadLetter", letter["offset"], 0)] = (offset, {"offset": letter["offset"],
                                                                   "reason": letter["reason"]})
        _diff(names["branch-events-dlq"], p, expected, found, low, high, report)


def _keyed(kind: str, records: list[dict]) -> Iterable[tuple[tuple, dict]]:
    counts: dict[int, int] = {}
    for record in records:
        n = counts.get(record["input_offset"], 0)
        counts[record["input_offset"]] = n + 1
        yield (kind, record["input_offset"], n), record


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

    Partitions are independent (each its own ledger and ledger time), so they are split over `jobs`
    processes (default: one per core, at most one per partition); this process takes one share itself.
    `live_ledgers`: the live ledgers per partition (`ledger_snapshot`s), or a `LiveProjections` that each
    process opens for its own partitions. `keep_folded`: return each partition's `ReplayResult` and store
    in `Report.folded` (for `--json`; the other processes then send them back)."""
    started = time.monotonic()
    topic = names["branch-events"]
    partitions = partitions if partitions is not None else partitions_of(client_config, topic)
    sizes = input_sizes(client_config, topic, partitions)
    report = Report(partitions=partitions)
    progress = Progress(sum(sizes.values()), stream=progress_stream or sys.stderr)
    shares = split(sizes, _jobs(jobs, partitions, codec, store_factory))
    jobs_ = [_Job(client_config, names, share, offset_range, _live_share(live_ledgers, share), keep_folded,
                  store_factory) for share in shares]
    done = _run_jobs(jobs_, progress, codec)
    progress.finish()
    by_partition = {p: part for job_parts in done for p, part in job_parts.items()}
    # divergences in the order a sequential replay reports them: topic by topic, then the ledgers
    for section in (*DERIVED, "branch-events-dlq", "ledger"):
        for p in sorted(by_partition):
            report.divergences.extend(by_partition[p].divergences.get(section, ()))
    report.events = sum(part.events for part in by_partition.values())
    report.compared = sum(part.compared for part in by_partition.values())
    if keep_folded:
        report.folded = {p: by_partition[p].folded for p in sorted(by_partition)}
    report.seconds = time.monotonic() - started
    return report


def input_sizes(client_config: dict, topic: str, partitions: list[int]) -> dict[int, int]:
    """Records in each partition of the input (end - beginning: a share's weight, markers included)."""
    consumer = Consumer({**client_config, "group.id": GROUP_ID, **READER_SETTINGS})
    try:
        sizes = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            sizes[p] = max(high - low, 0)
        return sizes
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"offsets of {topic}", exc) from None
    finally:
        consumer.close()


def split(sizes: dict[int, int], jobs: int) -> list[list[int]]:
    """Partitions in `jobs` shares of about equal input, the largest first; each share sorted."""
    shares: list[list[int]] = [[] for _ in range(max(1, min(jobs, len(sizes))))]
    loads = [0] * len(shares)
    for p in sorted(sizes, key=lambda p: (-sizes[p], p)):
        i = loads.index(min(loads))
        shares[i].append(p)
        loads[i] += sizes[p]
    return [sorted(share) for share in shares if share]


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
    """The live projections of a processor's state directory (`<state dir>/<group>/partition-N`), opened
    read-only by whichever process replays partition N."""

    root: str

    def open(self, partition: int) -> Store | None:
        path = os.path.join(self.root, f"partition-{partition}")
        return RocksStore(path, read_only=True) if os.path.exists(path) else None


def _live_share(live, share: list[int]):
    if live is None or isinstance(live, LiveProjections):
        return live
    return {p: live[p] for p in share if p in live}


@dataclass
class _Job:
    client_config: dict
    names: dict[str, str]
    partitions: list[int]
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


def _run_jobs(jobs: list[_Job], progress: Progress, codec: Codec) -> list[dict[int, _Partition]]:
    """The first job in this process, each other in a fresh process started first; their results."""
    if len(jobs) == 1:
        return [_replay_share(jobs[0], progress, codec)]
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold librdkafka threads
    counter = ctx.Value("q", 0, lock=False)
    workers = []
    try:
        for job in jobs[1:]:
            receive, send = ctx.Pipe(duplex=False)
            worker = ctx.Process(target=_worker, args=(job, counter, send), daemon=True)
            worker.start()
            send.close()
            workers.append((worker, receive))
        own_done = 0

        def own_progress(n: int) -> None:
            nonlocal own_done
            own_done += n
            progress.update(own_done + counter.value)

        results = [_replay_share(jobs[0], own_progress, codec)]
        for worker, receive in workers:
            try:
                status, value = receive.recv()
            except EOFError:
                raise KafkaFailure(f"a replay process died (exit code {worker.join(5) or worker.exitcode})") from None
            if status != "ok":
                raise KafkaFailure(value)
            results.append(value)
        return results
    finally:
        for worker, receive in workers:
            receive.close()
            worker.join(10)
            if worker.is_alive():
                worker.kill()


def _worker(job: _Job, counter, send) -> None:
    def progress(n: int) -> None:
        counter.value += n  # one writer per 1000 events each; a lost update only slows the bar

    try:
        result = ("ok", _replay_share(job, progress))
    except BaseException as exc:  # the message travels; the exception's class may not unpickle
        result = ("error", f"{type(exc).__name__}: {exc}")
    send.send(result)
    send.close()


def _replay_share(job: _Job, progress, codec: Codec | None = None) -> dict[int, _Partition]:
    """Read this share's partitions of the input and the four output topics with one consumer, fold each
    input record as it arrives, then compare every partition."""
    codec = codec or default_codec()
    names, partitions = job.names, job.partitions
    store_factory = job.store_factory or MemoryStore
    replayers = {p: Replayer(store_factory(), codec=codec, partition=p) for p in partitions}
    outputs = {(t, p): _Output() for t in OUTPUT_TOPICS for p in partitions}
    consumer = Consumer({**job.client_config, "group.id": GROUP_ID, **READER_SETTINGS})
    try:
        _fold_inputs(consumer, names, replayers, outputs, codec, progress)
        _read_outputs(consumer, names, outputs)
    except KafkaException as exc:
        raise KafkaFailure.wrap("reading the topics", exc) from None
    finally:
        consumer.close()
    parts = {}
    for p in partitions:
        result, store = replayers[p].finish()
        part = _Partition(events=len(result.dead_letters) + result.events)
        published = {t: outputs[(t, p)].records for t in OUTPUT_TOPICS}
        _compare_partition(p, result, published, codec, job.offset_range, names, part)
        if job.live is not None:
            _compare_ledger(p, store, job.live, codec, part)
        if job.keep_folded:
            part.folded = (result, store)
        parts[p] = part
    return parts


class _Output:
    """What was read of one output topic-partition."""

    __slots__ = ("records", "end", "eof", "done")

    def __init__(self) -> None:
        self.records: list[tuple[int, bytes]] = []  # (offset, value)
        self.end: int | None = None  # where reading stops: decided once the fold is done
        self.eof = -1  # the highest end-of-partition position seen before that
        self.done = False

    def take(self, message, err, name: str, p: int) -> None:
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                raise KafkaFailure(f"reading {name}[{p}]: {err.str()} ({err.name()})", code=err.name())
            if self.end is None:
                self.eof = max(self.eof, message.offset())
            else:
                self.done = True
            return
        offset = message.offset()
        if self.end is not None and offset >= self.end:
            self.done = True
            return
        self.records.append((offset, message.value()))
        if self.end is not None and offset >= self.end - 1:
            self.done = True


def _fold_inputs(consumer, names: dict[str, str], replayers: dict[int, Replayer], outputs: dict, codec: Codec,
                 progress) -> None:
    """Every committed input record, folded as it arrives. The output topics are assigned at the same time
    (from the beginning), so the broker sends them while the inputs are folded; where they end is decided
    only once the fold is done (`_read_outputs`), as when they were read after it."""
    topic = names["branch-events"]
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in replayers}
    pending = {p for p, end in ends.items() if end > 0}
    logical = {names[t]: t for t in OUTPUT_TOPICS}
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(pending)] +
                    [TopicPartition(names[t], p, OFFSET_BEGINNING) for t, p in outputs])
    decode_event = codec.decode_event
    feeds = {p: r.feed for p, r in replayers.items()}
    since_progress = 0
    while pending:
        for message in consumer.consume(num_messages=BATCH, timeout=IDLE_WAIT_S):
            name = message.topic()
            p = message.partition()
            err = message.error()
            if name != topic:
                outputs[(logical[name], p)].take(message, err, name, p)
                continue
            if p not in pending:
                continue
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(p)
                    continue
                raise KafkaFailure(f"reading {topic}[{p}]: {err.str()} ({err.name()})", code=err.name())
            offset = message.offset()
            if offset >= ends[p]:
                pending.discard(p)
                continue
            value = message.value()
            try:
                item = Input(offset, decode_event(value or b""))
            except CodecError as exc:
                item = Input(offset, None, str(exc))
            feeds[p](item)
            since_progress += 1
            if since_progress == 1000:
                progress(1000)
                since_progress = 0
            if offset >= ends[p] - 1:
                pending.discard(p)
    progress(since_progress)
    consumer.incremental_unassign([TopicPartition(topic, p) for p in sorted(ends) if ends[p] > 0])


def _read_outputs(consumer, names: dict[str, str], outputs: dict[tuple[str, int], _Output]) -> None:
    """The output topics up to their ends now (the last stable offsets, under read_committed)."""
    logical = {names[t]: t for t in OUTPUT_TOPICS}
    for (t, p), out in outputs.items():
        out.end = consumer.get_watermark_offsets(TopicPartition(names[t], p), timeout=10)[1]
        if out.records and out.records[-1][0] >= out.end:
            out.records[:] = [r for r in out.records if r[0] < out.end]
        last = out.records[-1][0] if out.records else -1
        out.done = out.end == 0 or out.eof >= out.end or last >= out.end - 1
    pending = {key for key, out in outputs.items() if not out.done}
    while pending:
        for message in consumer.consume(num_messages=BATCH, timeout=IDLE_WAIT_S):
            name, p = message.topic(), message.partition()
            key = (logical[name], p)
            out = outputs[key]
            if out.done:
                continue
            out.take(message, message.error(), name, p)
            if out.done:
                pending.discard(key)


def _compare_partition(p: int, result: ReplayResult, published: dict, codec: Codec, offset_range: tuple[int, int],
                       names: dict[str, str], part: _Partition) -> None:
    """The derived outputs of one partition against the published ones. Published records are compared as
    bytes with the derived records encoded the same way, in order; only a topic-partition where they differ
    is decoded and matched record by record (`_diff`), which pinpoints each divergence."""
    low, high = offset_range
    for topic, routes in DERIVED.items():
        derived = [(kind, getattr(result.outputs, attr)) for kind, attr in routes]
        rows = published[topic]
        report = Report()
        if _same_bytes(derived, rows, codec):
            full = low <= 0 and high >= sys.maxsize
            report.compared = (sum(len(records) for _, records in derived) if full else
                               sum(1 for _, records in derived for r in records if low <= r["input_offset"] <= high))
        else:
            expected = {key: record for kind, records in derived for key, record in _keyed(kind, records)}
            decoded = [(offset, *codec.decode(value)) for offset, value in rows]
            _diff(names[topic], p, expected, _keyed_published(decoded), low, high, report)
        part.compared += report.compared
        part.divergences[topic] = report.divergences
    report = Report()
    expected = {("DeadLetter", letter["offset"], 0): {"offset": letter["offset"], "reason": letter["reason"]}
                for letter in result.dead_letters}
    found = {}
    for offset, value in published["branch-events-dlq"]:
        letter = codec.decode(value)[1]
        found[("DeadLetter", letter["offset"], 0)] = (offset, {"offset": letter["offset"], "reason": letter["reason"]})
    _diff(names["branch-events-dlq"], p, expected, found, low, high, report)
    part.compared += report.compared
    part.divergences["branch-events-dlq"] = report.divergences


def _same_bytes(derived: list[tuple[str, list[dict]]], rows: list[tuple[int, bytes]], codec: Codec) -> bool:
    """Whether the published values are exactly the derived records, encoded, each kind in its order (kinds
    interleave as checkpoints cut them; a kind's schema fingerprint heads its bytes, so no record of one
    kind equals one of another)."""
    if sum(len(records) for _, records in derived) != len(rows):
        return False
    encode = codec.encode
    try:
        if len(derived) == 1:
            kind, records = derived[0]
            return all(encode(kind, record) == value for record, (_, value) in zip(records, rows))
        position = [0] * len(derived)
        upcoming: list[bytes | None] = [None] * len(derived)
        for _, value in rows:
            for i, (kind, records) in enumerate(derived):
                if position[i] == len(records):
                    continue
                if upcoming[i] is None:
                    upcoming[i] = encode(kind, records[position[i]])
                if upcoming[i] == value:
                    position[i] += 1
                    upcoming[i] = None
                    break
            else:
                return False
        return True
    except CodecError:
        return False  # a derived record the codec refuses: the record-by-record comparison says where


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
