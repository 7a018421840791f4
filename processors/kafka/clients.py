"""Clients for the two sides of the processor.

`BranchEventProducer`: what an orchestrator's adapter uses to publish branch events: an idempotent
producer, keyed by parent_id (murmur2, the same partitioner as the Java client), Avro single-object
encoded, one typed method per event. `read_outputs`: typed records from the output topics, read_committed.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.schemas.codec import Codec, default_codec
from branch_settlement.processors.kafka.errors import PublishFailed, TickNotProducible

TICK_NOT_PRODUCIBLE = ("a Tick is not produced: only the processor advances ledger time (its own ticks, on "
                       "ledger-ticks); for a simulated clock run it with --clock-file")


class BranchEventProducer:
    def __init__(self, client_config: dict, topic: str = "branch-events", codec: Codec | None = None) -> None:
        self.topic = topic
        self.codec = codec or default_codec()
        self._producer = Producer({**client_config, "enable.idempotence": True, "acks": "all",
                                   "partitioner": "murmur2_random", "linger.ms": 5})
        self._failures: list[KafkaError] = []
        self._seq = itertools.count(1)

    def _delivered(self, err, msg) -> None:
        if err is not None:
            self._failures.append(err)

    def publish(self, event: dict) -> None:
        """Publish one event in its JSON form (validated first: a CodecError names the bad field), keyed by
        its parent id. A Tick is refused (TickNotProducible): only the processor advances ledger time."""
        event = self.codec.event_from_json(event)
        if event["type"] == "Tick":
            raise TickNotProducible(TICK_NOT_PRODUCIBLE)
        value = self.codec.encode_event(event)
        key = event["parent_id"].encode()
        while True:
            try:
                self._producer.produce(self.topic, value=value, key=key, on_delivery=self._delivered)
                break
            except BufferError:
                self._producer.poll(0.05)
        self._producer.poll(0)

    def partitions(self, timeout_s: float = 10.0) -> list[int]:
        metadata = self._producer.list_topics(self.topic, timeout=timeout_s)
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None:
            raise KafkaFailure(f"topic {self.topic} is not available: {topic.error if topic else 'missing'}")
        return sorted(topic.partitions)

    def flush(self, timeout_s: float = 30.0) -> None:
        remaining = self._producer.flush(timeout_s)
        if self._failures or remaining:
            first = self._failures[0].str() if self._failures else "timed out"
            count = len(self._failures) + remaining
            self._failures.clear()
            raise PublishFailed(f"{count} events not acknowledged: {first}")

    # -- one typed method per event --------------------------------------------------------------------

    def _send(self, etype: str, parent_id: str, idempotency_key: str, occurred_at_ms: int,
              event_id: str | None, **fields) -> None:
        self.publish({"type": etype, "event_id": event_id or f"{uuid.uuid4()}", "idempotency_key": idempotency_key,
                      "parent_id": parent_id, "occurred_at_ms": occurred_at_ms, **fields})

    def parent_reserved(self, parent_id, *, capacity, lease_ttl_ms, policy, idempotency_key, occurred_at_ms,
                        event_id=None):
        self._send("ParentReserved", parent_id, idempotency_key, occurred_at_ms, event_id, capacity=capacity,
                   lease_ttl_ms=lease_ttl_ms, policy=policy)

    def child_reserved(self, parent_id, *, child_id, branch_id, attempt_id, quantities, idempotency_key,
                       occurred_at_ms, event_id=None):
        self._send("ChildReserved", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   branch_id=branch_id, attempt_id=attempt_id, quantities=quantities)

    def child_activated(self, parent_id, *, child_id, attempt_id, lease_generation, lease_ttl_ms, idempotency_key,
                        occurred_at_ms, event_id=None):
        self._send("ChildActivated", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, lease_generation=lease_generation, lease_ttl_ms=lease_ttl_ms)

    def lease_renewed(self, parent_id, *, child_id, attempt_id, lease_generation, lease_ttl_ms, idempotency_key,
                      occurred_at_ms, event_id=None):
        self._send("LeaseRenewed", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, lease_generation=lease_generation, lease_ttl_ms=lease_ttl_ms)

    def usage_reported(self, parent_id, *, child_id, attempt_id, lease_generation, usage_report_id, usage,
                       final=False, idempotency_key, occurred_at_ms, event_id=None):
        self._send("UsageReported", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, lease_generation=lease_generation, usage_report_id=usage_report_id,
                   usage=usage, final=final)

    def child_completed(self, parent_id, *, child_id, attempt_id, lease_generation, usage, idempotency_key,
                        occurred_at_ms, event_id=None):
        self._send("ChildCompleted", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, lease_generation=lease_generation, usage=usage)

    def child_skipped(self, parent_id, *, child_id, attempt_id, reason="", idempotency_key, occurred_at_ms,
                      event_id=None):
        self._send("ChildSkipped", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, reason=reason)

    def cancel_requested(self, parent_id, *, child_id, attempt_id, reason="", idempotency_key, occurred_at_ms,
                         event_id=None):
        self._send("CancelRequested", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, reason=reason)

    def cancel_acknowledged(self, parent_id, *, child_id, attempt_id, lease_generation, usage=None,
                            usage_uncertain=False, retry_attempt_id=None, idempotency_key, occurred_at_ms,
                            event_id=None):
        self._send("CancelAcknowledged", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, lease_generation=lease_generation, usage=usage,
                   usage_uncertain=usage_uncertain, retry_attempt_id=retry_attempt_id)

    def child_failed(self, parent_id, *, child_id, attempt_id, lease_generation, activated, usage=None,
                     usage_uncertain=False, reason="", retry_attempt_id=None, idempotency_key, occurred_at_ms,
                     event_id=None):
        self._send("ChildFailed", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, lease_generation=lease_generation, activated=activated, usage=usage,
                   usage_uncertain=usage_uncertain, reason=reason, retry_attempt_id=retry_attempt_id)

    def speculative_winner(self, parent_id, *, branch_id, winner_attempt_id, idempotency_key, occurred_at_ms,
                           event_id=None):
        self._send("SpeculativeWinner", parent_id, idempotency_key, occurred_at_ms, event_id, branch_id=branch_id,
                   winner_attempt_id=winner_attempt_id)

    def reservation_transferred(self, parent_id, *, child_id, from_attempt_id, to_attempt_id, idempotency_key,
                                occurred_at_ms, event_id=None):
        self._send("ReservationTransferred", parent_id, idempotency_key, occurred_at_ms, event_id,
                   child_id=child_id, from_attempt_id=from_attempt_id, to_attempt_id=to_attempt_id)

    def reconciliation_resolved(self, parent_id, *, child_id, attempt_id, usage, resolution, idempotency_key,
                                occurred_at_ms, event_id=None):
        self._send("ReconciliationResolved", parent_id, idempotency_key, occurred_at_ms, event_id,
                   child_id=child_id, attempt_id=attempt_id, usage=usage, resolution=resolution)

    def usage_adjustment(self, parent_id, *, child_id, attempt_id, usage, reason="", idempotency_key,
                         occurred_at_ms, event_id=None):
        self._send("UsageAdjustment", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                   attempt_id=attempt_id, usage=usage, reason=reason)

    def scheduler_release_confirmed(self, parent_id, *, child_id, attempt_id, dimension, idempotency_key,
                                    occurred_at_ms, event_id=None):
        self._send("SchedulerReleaseConfirmed", parent_id, idempotency_key, occurred_at_ms, event_id,
                   child_id=child_id, attempt_id=attempt_id, dimension=dimension)

    def parent_closed(self, parent_id, *, outcome, idempotency_key, occurred_at_ms, event_id=None):
        self._send("ParentClosed", parent_id, idempotency_key, occurred_at_ms, event_id, outcome=outcome)


_NOT_READY = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                        KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TIMED_OUT})


def high_watermark(consumer: Consumer, tp: TopicPartition, timeout_s: float = 15.0) -> int:
    """The partition's end offset, asked again while the broker says it is not ready (a topic just created:
    its leader not yet known everywhere)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return consumer.get_watermark_offsets(tp, timeout=max(deadline - time.monotonic(), 1))[1]
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or not (err.retriable() or err.code() in _NOT_READY) \
                    or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def positions_reached(consumer: Consumer, partitions: list[tuple[str, int]], ends: dict[tuple[str, int], int]
                      ) -> set[tuple[str, int]]:
    """The (topic, partition)s whose position is at or past its end in `ends`: the last records before it
    may be transaction markers or aborted records, never delivered, and while the processor writes (its
    ticks, every interval) the end moves on before an end-of-partition event could say it was reached."""
    if not partitions:
        return set()
    positions = consumer.position([TopicPartition(topic, p) for topic, p in partitions])
    return {(tp.topic, tp.partition) for tp in positions if tp.offset >= 0 and tp.offset >= ends[(tp.topic, tp.partition)]}


@dataclass(frozen=True)
class OutputRecord:
    kind: str  # "SettlementResult", "CapacityReleased", "ParentSettled", "AuditRecord", "DeadLetter"
    record: dict
    topic: str
    partition: int
    offset: int


def read_outputs(client_config: dict, topics: list[str], *, group_id: str | None = None,
                 until_end: bool = True, idle_timeout_s: float = 5.0, codec: Codec | None = None
                 ) -> Iterator[OutputRecord]:
    """Typed records of the output topics, read_committed: only what a committed transaction wrote.
    With `until_end` (default) it stops at the end every partition had when reading began (the processor
    writes its ticks' results every interval: the ends move on); without a group it reads from the
    beginning and commits nothing (an audit read)."""
    codec = codec or default_codec()
    consumer = Consumer({**client_config, "group.id": group_id or f"settle-reader-{uuid.uuid4()}",
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                         "enable.auto.commit": group_id is not None, "enable.partition.eof": True})
    try:
        metadata = consumer.list_topics(timeout=10)
        assignment = [TopicPartition(t, p) for t in topics for p in metadata.topics[t].partitions]
        # the ends before fetching starts: an end-of-partition event is then never one of an earlier end
        ends = {(tp.topic, tp.partition): high_watermark(consumer, tp) for tp in assignment}
        if group_id is None:
            for tp in assignment:
                tp.offset = -2  # OFFSET_BEGINNING
            consumer.assign(assignment)
        else:
            consumer.subscribe(topics)
        at_end: set[tuple[str, int]] = {tp for tp, end in ends.items() if end == 0}
        idle_since = None
        while True:
            messages = consumer.consume(num_messages=1_000, timeout=0.5)
            if not messages:
                idle_since = idle_since or time.monotonic()
                if until_end and time.monotonic() - idle_since > idle_timeout_s:
                    return
                continue
            idle_since = None
            for message in messages:
                err = message.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        where = (message.topic(), message.partition())
                        if message.offset() >= ends[where]:
                            at_end.add(where)
                        continue
                    raise KafkaException(err)
                if until_end and message.offset() >= ends[(message.topic(), message.partition())]:
                    continue
                kind, record = codec.decode(message.value())
                yield OutputRecord(kind, record, message.topic(), message.partition(), message.offset())
            if until_end:
                at_end |= positions_reached(consumer, [tp for tp in ends if tp not in at_end], ends)
                if len(at_end) == len(assignment):
                    return
    finally:
        consumer.close()
