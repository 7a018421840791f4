"""The processor's metric updates: the count of folded events by result, what each checkpoint did (its
outcome, its duration, what it released), and the gauges of the owned partitions (ledger capacity, lag).
"""

from __future__ import annotations

import time
from typing import Iterable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.processors.kafka.txn_guard import stuck_calls


class EventCounters:
    """The events counter per result code, each child looked up once: labels() costs a lock and a lookup,
    too much for every event."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._counters: dict = {}

    def count(self, code: str) -> None:
        counter = self._counters.get(code)
        if counter is None:
            counter = self._counters[code] = self._metrics.events.labels(code)
        counter.inc()


def record_checkpoint(metrics: Metrics, committed: bool, elapsed: float) -> None:
    """Every checkpoint, committed or not."""
    metrics.transactions.labels("committed" if committed else "aborted").inc()
    metrics.checkpoint_seconds.set(elapsed)
    metrics.checkpoint_duration.observe(elapsed)
    metrics.stuck_calls.set(stuck_calls())


def record_commit(metrics: Metrics, result) -> None:
    """A committed checkpoint: when, how many events, what it released."""
    metrics.last_commit.set(time.time())
    metrics.checkpoint_events.observe(result.events)
    for (dimension, destination), quantity in result.released.items():
        metrics.releases.labels(dimension, destination).inc(quantity)


def update_gauges(metrics: Metrics, tasks: Iterable[PartitionTask], consumer: Consumer, input_topic: str) -> None:
    """The owned partitions' ledger capacity, summed, and each one's lag behind the input's high watermark
    (as the consumer last saw it: no request)."""
    totals: dict[tuple[str, str], int] = {}
    for task in tasks:
        for key, value in task.capacity.items():
            totals[key] = totals.get(key, 0) + value
        tp = TopicPartition(input_topic, task.partition)
        try:
            _, high = consumer.get_watermark_offsets(tp, cached=True)
        except KafkaException:
            continue
        if high >= 0 and task.committed_position >= 0:
            metrics.lag.labels(str(task.partition)).set(max(high - task.committed_position, 0))
    for (term, dim), value in totals.items():
        metrics.capacity.labels(term, dim).set(value)
