"""Whether what this processor committed became readable: the partitions that read_committed consumers cannot
read past.

A committed transaction is readable once its markers are written, milliseconds after the commit. If the last
stable offset (LSO) of a partition this processor wrote to stays at or below a record it committed for longer
than any transaction of its own can stay open, something earlier in that partition holds it: an open
transaction of another producer with a long `transaction.timeout.ms`, or a hanging transaction that no
coordinator will ever end (Kafka can leave one behind after a broker crash: docs/faults.md, finding 2).
Downstream schedulers then see none of the releases behind it. The processor cannot safely end it (the marker
it would write, abort or commit, may contradict the coordinator), so it says so, once, loudly, with the
partition and the offset, keeps a gauge at 1 while it lasts, and says when it clears.

The check never blocks the loop: the ListOffsets (read_committed) request runs in the admin client's
background thread and is looked at on a later step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

log = logging.getLogger("settle.processor")

MIN_THRESHOLD_S = 10.0
REQUEST_TIMEOUT_S = 10.0


@dataclass
class _Unconfirmed:
    oldest_offset: int  # the oldest committed record not yet seen readable
    oldest_at: float  # when it was committed (monotonic)
    latest_offset: int  # the newest committed record
    latest_at: float
    alerted: bool = False


def stall_threshold_s(transaction_timeout_ms: int) -> float:
    """Twice the longest any transaction of ours can stay open: past that, it is not ours that holds the LSO."""
    return max(2 * transaction_timeout_ms / 1000, MIN_THRESHOLD_S)


class StabilityWatch:
    def __init__(self, admin_factory: Callable[[], AdminClient], threshold_s: float, gauge,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._admin_factory = admin_factory
        self._admin: AdminClient | None = None
        self.threshold_s = threshold_s
        self.interval_s = min(threshold_s / 2, 10.0)
        self._gauge = gauge
        self._clock = clock
        self._unconfirmed: dict[tuple[str, int], _Unconfirmed] = {}
        self._pending: dict[TopicPartition, Future] | None = None
        self._last_query = clock()

    def committed(self, offsets: dict[tuple[str, int], int]) -> None:
        """After a commit: the offset of the last record it committed on each topic-partition."""
        now = self._clock()
        for tp, offset in offsets.items():
            entry = self._unconfirmed.get(tp)
            if entry is None:
                self._unconfirmed[tp] = _Unconfirmed(offset, now, offset, now)
            elif offset > entry.latest_offset:
                entry.latest_offset, entry.latest_at = offset, now

    def forget(self, topic_partitions) -> None:
        """Partitions this process no longer writes to (revoked or lost): another owner watches them now."""
        for tp in list(topic_partitions):
            entry = self._unconfirmed.pop(tp, None)
            if entry is not None and entry.alerted:
                self._gauge.labels(tp[0], str(tp[1])).set(0)

    def unreadable(self) -> list[tuple[str, int]]:
        return sorted(tp for tp, entry in self._unconfirmed.items() if entry.alerted)

    def poll(self) -> None:
        """Cheap when nothing is due: look at a finished query, or send the next one."""
        if self._pending is not None:
            if not all(future.done() for future in self._pending.values()):
                return
            self._evaluate(self._pending)
            self._pending = None
        now = self._clock()
        if not self._unconfirmed or now - self._last_query < self.interval_s:
            return
        self._last_query = now
        if self._admin is None:
            self._admin = self._admin_factory()
        request = {TopicPartition(topic, partition): OffsetSpec.latest() for topic, partition in self._unconfirmed}
        try:
            self._pending = self._admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED,
                                                     request_timeout=REQUEST_TIMEOUT_S)
        except KafkaException as exc:
            log.debug("last stable offsets not queried: %s", exc)

    def _evaluate(self, futures: dict[TopicPartition, Future]) -> None:
        now = self._clock()
        for tp, future in futures.items():
            key = (tp.topic, tp.partition)
            entry = self._unconfirmed.get(key)
            if entry is None:
                continue
            try:
                stable = future.result().offset
            except KafkaException as exc:  # the broker is away: ask again next time
                log.debug("last stable offset of %s[%d] not known: %s", tp.topic, tp.partition, exc)
                continue
            if stable < 0:  # OFFSET_INVALID (-1001), answered after a leader failover: no LSO, ask again
                continue
            if stable > entry.latest_offset:
                del self._unconfirmed[key]
                if entry.alerted:
                    self._gauge.labels(tp.topic, str(tp.partition)).set(0)
                    log.warning("%s[%d] is readable again: its last stable offset passed %d, the last record this "
                                "processor committed there", tp.topic, tp.partition, entry.latest_offset)
                continue
            if stable > entry.oldest_offset:  # the oldest is readable; the newest is not known to be
                entry.oldest_offset, entry.oldest_at = entry.latest_offset, entry.latest_at
            if not entry.alerted and now - entry.oldest_at > self.threshold_s:
                entry.alerted = True
                self._gauge.labels(tp.topic, str(tp.partition)).set(1)
                log.critical(
                    "%s[%d] IS NOT READABLE past offset %d: read_committed consumers (schedulers, quota services, "
                    "this processor's own restore) see nothing after it, including the record this processor "
                    "committed at offset %d %.0f s ago, longer than any transaction of its own can stay open. "
                    "An open transaction of another producer, or a hanging transaction Kafka left behind after a "
                    "broker crash (docs/faults.md, finding 2), holds it. Find it with kafka-transactions.sh "
                    "--bootstrap-server ... find-hanging --broker-id N (or describe-producers --topic %s "
                    "--partition %d). This processor goes on committing; it does not end another transaction.",
                    tp.topic, tp.partition, stable, entry.oldest_offset, now - entry.oldest_at, tp.topic,
                    tp.partition)

    def close(self) -> None:
        self._pending = None
        self._admin = None
