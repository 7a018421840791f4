"""Latency from the produce of an event to its result being visible to a read_committed consumer, at fixed
fractions of the processor's measured maximum throughput.

One process drives both ends (one monotonic clock): a rate-limited producer (an orchestrator's settings:
idempotent, acks=all, linger.ms=5) publishes the seeded workload at `rate` input records per second, noting
when each event was handed to the producer; a thread reads `settlement-results` read_committed and matches
each result to its event by event_id (in order, for the ids a workload repeats: duplicate deliveries).
Undecodable records are sent too but have no result to wait for; the results of the processor's own ticks
(its clock's, not the workload's) match no event sent and are passed over.

The system under test is started by the caller: `settle run`, or the pass-through in echo mode (the
latency ceiling: the same transactions with no fold).

The driver's own cyclic garbage collector is off while it measures (`quiet_gc`): it holds the whole workload
(1.5M records in a full run) and a deque per event it waits for, and one full collection of that heap took
560-660 ms here, a stall of the reader thread that showed as the max latency of the processor and of the
pass-through alike (705 and 842 ms in one run) and as their p99 when it fell inside a level."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from bench.suite.backlog import Record, produce, producer_config
from bench.suite.env import INPUT, RESULTS, Env, TopicSet
from bench.suite.procs import Child, clock_of_day, wait_assigned
from branch_settlement.schemas.codec import HEADER_SIZE, SINGLE_OBJECT_MARKER

SEND_QUANTUM_S = 0.002
DRAIN_TIMEOUT_S = 60.0


@dataclass
class Level:
    fraction: float
    rate: float  # input records per second asked
    achieved_rate: float
    sent: int
    matched: int
    latencies_ms: list[float]
    checkpoints: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        lat = sorted(self.latencies_ms)
        return {"load": self.fraction, "rate_events_per_s": round(self.rate), "achieved_events_per_s":
                round(self.achieved_rate), "events": self.sent, "results_matched": self.matched,
                "p50": percentile(lat, 50), "p99": percentile(lat, 99), "max": round(lat[-1], 1) if lat else None,
                "checkpoints": self.checkpoints}


def percentile(ordered: list[float], pct: float) -> float | None:
    """Nearest rank."""
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * pct // 100))
    return round(ordered[int(rank) - 1], 1)


def leading_event_id(value: bytes | None) -> str | None:
    """The event_id of a single-object encoded SettlementResult (or event: the pass-through echoes those),
    without decoding the rest: it is the first field of every such schema, a zig-zag varint length and
    UTF-8 bytes after the 10-byte header. Keeps the reader cheap on a machine whose cores are all busy."""
    if not value or value[:2] != SINGLE_OBJECT_MARKER or len(value) <= HEADER_SIZE:
        return None
    shift, raw, i = 0, 0, HEADER_SIZE
    while i < len(value):
        byte = value[i]
        raw |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            break
        shift += 7
    length = (raw >> 1) ^ -(raw & 1)
    if length < 0 or i + length > len(value):
        return None
    try:
        return value[i:i + length].decode()
    except UnicodeDecodeError:
        return None


def watermark(consumer: Consumer, tp: TopicPartition, timeout_s: float = 30.0) -> int:
    """The high watermark, retried while a fresh topic's leadership settles (NOT_LEADER_FOR_PARTITION)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return consumer.get_watermark_offsets(tp, timeout=10)[1]
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class ResultWatcher(threading.Thread):
    def __init__(self, client_config: dict, topic: str, partitions: int) -> None:
        super().__init__(daemon=True)
        self.sent: dict[str, deque] = defaultdict(deque)
        self.latencies: list[float] = []
        self.matched = 0
        self.stop_flag = threading.Event()
        self.consumer = Consumer({**client_config, "group.id": "bench-latency-reader", "enable.auto.commit": False,
                                  "isolation.level": "read_committed", "fetch.wait.max.ms": 10})
        ends = [watermark(self.consumer, TopicPartition(topic, p)) for p in range(partitions)]
        self.consumer.assign([TopicPartition(topic, p, end) for p, end in enumerate(ends)])

    def expect(self, event_id: str, sent_at: float) -> None:
        self.sent[event_id].append(sent_at)

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                # poll, not consume(n): consume waits until n messages or its timeout, which would add up
                # to the timeout to every latency at low rates.
                message = self.consumer.poll(0.05)
                seen = time.monotonic()
                if message is None or message.error():
                    continue
                event_id = leading_event_id(message.value())
                if event_id is None:
                    continue  # the latency ceiling echoes undecodable input too; it is no result
                waiting = self.sent.get(event_id)
                if waiting:
                    self.latencies.append((seen - waiting.popleft()) * 1000)
                    self.matched += 1
        finally:
            self.consumer.close()


def drive(producer: Producer, topic: str, records: list[Record], rate: float, watcher: ResultWatcher) -> float:
    """Send `records` at `rate` per second; returns the rate achieved."""
    started = time.monotonic()
    i = 0
    while i < len(records):
        due = min(len(records), int((time.monotonic() - started) * rate) + 1)
        while i < due:
            record = records[i]
            if record.match_id is not None:
                watcher.expect(record.match_id, time.monotonic())
            produce(producer, topic, record)
            i += 1
        producer.poll(0)
        time.sleep(SEND_QUANTUM_S)
    return len(records) / max(time.monotonic() - started, 1e-9)


@contextlib.contextmanager
def quiet_gc():
    """No cyclic collection in this process meanwhile (what it allocates while measuring holds no cycles
    worth collecting: records, deques, floats); what existed before is frozen out of later collections."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def measure(env: Env, topic_set: TopicSet, records: list[Record], rates: list[tuple[float, float]],
            seconds: float, warmup_s: float, start: Callable[[], Child], stop: Callable[[Child], int]) -> list[Level]:
    """`rates`: (load fraction, records per second) per level; the first level's rate also warms up."""
    child = start()
    watcher = ResultWatcher(env.client_config(), topic_set.name(RESULTS), topic_set.partitions)
    producer = Producer(producer_config(env.client_config()))
    levels = []
    try:
        with quiet_gc():
            wait_assigned([child], topic_set.partitions)
            watcher.start()
            cursor = 0
            for n, (fraction, rate) in enumerate([rates[0], *rates]):  # pass 0 warms up and is not reported
                count = int(rate * (warmup_s if n == 0 else seconds))
                batch = records[cursor:cursor + count]
                if len(batch) < count:
                    raise RuntimeError(f"latency workload too short: {len(records)} records")
                cursor += count
                waited = sum(1 for r in batch if r.match_id is not None)
                expected = watcher.matched + waited
                first = len(watcher.latencies)
                since = clock_of_day()
                achieved = drive(producer, topic_set.name(INPUT), batch, rate, watcher)
                until = clock_of_day()
                producer.flush(30)
                deadline = time.monotonic() + DRAIN_TIMEOUT_S
                while watcher.matched < expected and time.monotonic() < deadline:
                    child.check_alive()
                    if not watcher.is_alive():
                        raise RuntimeError("the result reader stopped")
                    time.sleep(0.05)
                if n:
                    levels.append(Level(fraction, rate, achieved, len(batch), watcher.matched - (expected - waited),
                                        watcher.latencies[first:], child.checkpoints(since, until)))
    finally:
        watcher.stop_flag.set()
        watcher.join(10)
        stop(child)
    return levels


def records_needed(rates: list[tuple[float, float]], seconds: float, warmup_s: float) -> int:
    return int(rates[0][1] * warmup_s + sum(rate for _, rate in rates) * seconds) + 1
