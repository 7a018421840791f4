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

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from processors.kafka.errors import KafkaFailure
from processors.partitioned import decode_record, replay_partitions
from processors.replay import Input, ReplayResult, ledger_snapshot
from projections.store import Store
from schemas.codec import Codec

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
        self.done += n
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


def read_committed(client_config: dict, topic: str, partitions: Iterable[int], start: dict[int, int] | None = None,
                   end: dict[int, int] | None = None) -> dict[int, list]:
    """Committed records of `topic` per partition: (offset, key, value), from `start` (default: the
    beginning) up to the end offsets `end` (default: the ends when reading began)."""
    consumer = Consumer({**client_config, "group.id": "settle-audit-replay", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True})
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
            for message in consumer.consume(num_messages=10_000, timeout=1.0):
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
    consumer = Consumer({**client_config, "group.id": "settle-audit-replay"})
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
    consumer = Consumer({**client_config, "group.id": "settle-audit-replay"})
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


def audit_replay(client_config: dict, names: dict[str, str], codec: Codec, *, partitions: list[int] | None = None,
                 offset_range: tuple[int, int] = (0, sys.maxsize), live_ledgers: dict[int, dict] | None = None,
                 store_factory: Callable[[], Store] | None = None, progress_stream=None) -> Report:
    started = time.monotonic()
    topic = names["branch-events"]
    partitions = partitions if partitions is not None else partitions_of(client_config, topic)
    inputs = read_inputs(client_config, topic, partitions, codec)
    report = Report(partitions=partitions)
    report.events = sum(len(v) for v in inputs.values())
    progress = Progress(report.events, stream=progress_stream or sys.stderr)
    kwargs = {"store_factory": store_factory} if store_factory else {}
    folded = replay_partitions({p: (item for item, _ in recs) for p, recs in inputs.items()}, codec,
                               progress=progress, **kwargs)
    progress.finish()
    published = {t: read_committed(client_config, names[t], partitions) for t in OUTPUT_TOPICS}
    compare(folded, published, codec, offset_range, report, names)
    if live_ledgers:
        compare_ledgers(folded, live_ledgers, codec, report)
    report.folded = folded
    report.seconds = time.monotonic() - started
    return report


__all__ = ["audit_replay", "Report", "Divergence", "read_inputs", "read_committed", "partitions_of",
           "offsets_for_time", "Input"]
