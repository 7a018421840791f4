"""Clients for the two sides of the processor.

`BranchEventProducer`: what an orchestrator's adapter uses to publish branch events: an idempotent
producer, keyed by parent_id (murmur2, the same partitioner as the Java client), Avro single-object
encoded, one typed method per event; `publish_and_wait` also waits for the event's result. `ResultWaiter`:
the results of events published, read_committed from settlement-results. `read_outputs`: typed records
from the output topics, read_committed. The consumer side for downstream services is
processors/kafka/consumers.py.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka.consumers import SettlementResult, Source, decode_output
from branch_settlement.processors.kafka.errors import KafkaFailure, UndecodableOutput
from branch_settlement.schemas.codec import Codec, default_codec
from branch_settlement.processors.kafka.errors import PublishFailed, ResultTimeout, TickNotProducible
from branch_settlement.schemas.partitioning import partition_of

TICK_NOT_PRODUCIBLE = ("a Tick is not produced: only the processor advances ledger time (its own ticks, on "
                       "ledger-ticks); for a simulated clock run it with --clock-file")


INPUT_TOPIC = "branch-events"
RESULTS_TOPIC = "settlement-results"


class BranchEventProducer:
    """Publishes branch events. `results_topic` (for `publish_and_wait`) defaults to the input topic's name
    with `branch-events` replaced by `settlement-results`, the deployment's prefix kept."""

    def __init__(self, client_config: dict, topic: str = INPUT_TOPIC, codec: Codec | None = None, *,
                 results_topic: str | None = None) -> None:
        self.topic = topic
        self.codec = codec or default_codec()
        self._client_config = dict(client_config)
        self._producer = Producer({**client_config, "enable.idempotence": True, "acks": "all",
                                   "partitioner": "murmur2_random", "linger.ms": 5})
        self._failures: list[KafkaError] = []
        self._seq = itertools.count(1)
        if results_topic is None and topic.endswith(INPUT_TOPIC):
            results_topic = topic[:-len(INPUT_TOPIC)] + RESULTS_TOPIC
        self.results_topic = results_topic
        self._waiter: ResultWaiter | None = None
        self._waiter_lock = threading.Lock()

    def _delivered(self, err, msg) -> None:
        if err is not None:
            self._failures.append(err)

    def publish(self, event: dict) -> dict:
        """Publish one event in its JSON form (validated first: a CodecError names the bad field), keyed by
        its parent id, and return its canonical form (what was sent). A Tick is refused (TickNotProducible):
        only the processor advances ledger time. Delivery is asynchronous: `flush` waits for the broker."""
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
        return event

    def publish_and_wait(self, event: dict, timeout_s: float = 30.0) -> SettlementResult:
        """Publish one event, wait for the broker's acknowledgement, then for its result on
        settlement-results (read_committed: only a result the processor committed), and return it. Which
        result code came back is the caller's to judge (`result.applied`, `result.result`): a rejection is
        a result, not an exception. ResultTimeout when none came within `timeout_s` (the event was
        published: publishing it again is safe, its idempotency key decides)."""
        return self.publish_all_and_wait([event], timeout_s)[0]

    def publish_all_and_wait(self, events: list[dict], timeout_s: float = 30.0) -> list[SettlementResult]:
        """`publish_and_wait` for several events at once: their results, in the order of `events`."""
        events = [self.codec.event_from_json(event) for event in events]
        with self._waiter_lock:
            waiter = self._result_waiter()
            expected = waiter.expect(events)  # the results' partition ends before anything is published
            for event in events:
                self.publish(event)
            self.flush(timeout_s)
            return waiter.wait(expected, timeout_s)

    def _result_waiter(self) -> ResultWaiter:
        if self._waiter is None:
            if self.results_topic is None:
                raise ConfigError(f"BranchEventProducer(topic={self.topic!r}): pass results_topic= to wait for "
                                  "results (the name of the deployment's settlement-results topic)")
            self._waiter = ResultWaiter(self._client_config, results_topic=self.results_topic,
                                        input_partitions=len(self.partitions()), codec=self.codec)
        return self._waiter

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is still buffered (PublishFailed if the broker did not acknowledge it) and close the
        result reader, if one was opened."""
        try:
            self.flush(timeout_s)
        finally:
            if self._waiter is not None:
                self._waiter.close()
                self._waiter = None

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

    # -- one typed method per event: each returns the canonical event it sent (its event_id among it) ------

    def _send(self, etype: str, parent_id: str, idempotency_key: str, occurred_at_ms: int,
              event_id: str | None, **fields) -> dict:
        return self.publish({"type": etype, "event_id": event_id or f"{uuid.uuid4()}",
                             "idempotency_key": idempotency_key, "parent_id": parent_id,
                             "occurred_at_ms": occurred_at_ms, **fields})

    def parent_reserved(self, parent_id, *, capacity, lease_ttl_ms, policy, idempotency_key, occurred_at_ms,
                        event_id=None):
        return self._send("ParentReserved", parent_id, idempotency_key, occurred_at_ms, event_id, capacity=capacity,
                          lease_ttl_ms=lease_ttl_ms, policy=policy)

    def child_reserved(self, parent_id, *, child_id, branch_id, attempt_id, quantities, idempotency_key,
                       occurred_at_ms, event_id=None):
        return self._send("ChildReserved", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          branch_id=branch_id, attempt_id=attempt_id, quantities=quantities)

    def child_activated(self, parent_id, *, child_id, attempt_id, lease_generation, lease_ttl_ms, idempotency_key,
                        occurred_at_ms, event_id=None):
        return self._send("ChildActivated", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, lease_generation=lease_generation, lease_ttl_ms=lease_ttl_ms)

    def lease_renewed(self, parent_id, *, child_id, attempt_id, lease_generation, lease_ttl_ms, idempotency_key,
                      occurred_at_ms, event_id=None):
        return self._send("LeaseRenewed", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, lease_generation=lease_generation, lease_ttl_ms=lease_ttl_ms)

    def usage_reported(self, parent_id, *, child_id, attempt_id, lease_generation, usage_report_id, usage,
                       final=False, idempotency_key, occurred_at_ms, event_id=None):
        return self._send("UsageReported", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, lease_generation=lease_generation, usage_report_id=usage_report_id,
                          usage=usage, final=final)

    def child_completed(self, parent_id, *, child_id, attempt_id, lease_generation, usage, idempotency_key,
                        occurred_at_ms, event_id=None):
        return self._send("ChildCompleted", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, lease_generation=lease_generation, usage=usage)

    def child_skipped(self, parent_id, *, child_id, attempt_id, reason="", idempotency_key, occurred_at_ms,
                      event_id=None):
        return self._send("ChildSkipped", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, reason=reason)

    def cancel_requested(self, parent_id, *, child_id, attempt_id, reason="", idempotency_key, occurred_at_ms,
                         event_id=None):
        return self._send("CancelRequested", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, reason=reason)

    def cancel_acknowledged(self, parent_id, *, child_id, attempt_id, lease_generation, usage=None,
                            usage_uncertain=False, retry_attempt_id=None, idempotency_key, occurred_at_ms,
                            event_id=None):
        return self._send("CancelAcknowledged", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, lease_generation=lease_generation, usage=usage,
                          usage_uncertain=usage_uncertain, retry_attempt_id=retry_attempt_id)

    def child_failed(self, parent_id, *, child_id, attempt_id, lease_generation, activated, usage=None,
                     usage_uncertain=False, reason="", retry_attempt_id=None, idempotency_key, occurred_at_ms,
                     event_id=None):
        return self._send("ChildFailed", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, lease_generation=lease_generation, activated=activated, usage=usage,
                          usage_uncertain=usage_uncertain, reason=reason, retry_attempt_id=retry_attempt_id)

    def speculative_winner(self, parent_id, *, branch_id, winner_attempt_id, idempotency_key, occurred_at_ms,
                           event_id=None):
        return self._send("SpeculativeWinner", parent_id, idempotency_key, occurred_at_ms, event_id,
                          branch_id=branch_id, winner_attempt_id=winner_attempt_id)

    def reservation_transferred(self, parent_id, *, child_id, from_attempt_id, to_attempt_id, idempotency_key,
                                occurred_at_ms, event_id=None):
        return self._send("ReservationTransferred", parent_id, idempotency_key, occurred_at_ms, event_id,
                          child_id=child_id, from_attempt_id=from_attempt_id, to_attempt_id=to_attempt_id)

    def reconciliation_resolved(self, parent_id, *, child_id, attempt_id, usage, resolution, idempotency_key,
                                occurred_at_ms, event_id=None):
        return self._send("ReconciliationResolved", parent_id, idempotency_key, occurred_at_ms, event_id,
                          child_id=child_id, attempt_id=attempt_id, usage=usage, resolution=resolution)

    def usage_adjustment(self, parent_id, *, child_id, attempt_id, usage, reason="", idempotency_key,
                         occurred_at_ms, event_id=None):
        return self._send("UsageAdjustment", parent_id, idempotency_key, occurred_at_ms, event_id, child_id=child_id,
                          attempt_id=attempt_id, usage=usage, reason=reason)

    def scheduler_release_confirmed(self, parent_id, *, child_id, attempt_id, dimension, idempotency_key,
                                    occurred_at_ms, event_id=None):
        return self._send("SchedulerReleaseConfirmed", parent_id, idempotency_key, occurred_at_ms, event_id,
                          child_id=child_id, attempt_id=attempt_id, dimension=dimension)

    def parent_closed(self, parent_id, *, outcome, idempotency_key, occurred_at_ms, event_id=None):
        return self._send("ParentClosed", parent_id, idempotency_key, occurred_at_ms, event_id, outcome=outcome)

    # Explicit borrowing: a loan's events carry the loan's own idempotency keys (the default here; another key is
    # answered `invalid_event`).

    def loan_requested(self, parent_id, *, loan_id, borrower, quantities, occurred_at_ms, idempotency_key=None,
                       event_id=None):
        return self._send("LoanRequested", parent_id, idempotency_key or loan_key(parent_id, loan_id, "request"),
                          occurred_at_ms, event_id, loan_id=loan_id, borrower=borrower, quantities=quantities)

    def loan_returned(self, parent_id, *, loan_id, usage, occurred_at_ms, idempotency_key=None, event_id=None):
        return self._send("LoanReturned", parent_id, idempotency_key or loan_key(parent_id, loan_id, "return"),
                          occurred_at_ms, event_id, loan_id=loan_id, usage=usage)


def loan_key(parent_id: str, loan_id: str, verb: str) -> str:
    """The idempotency key of a loan's request (`verb` "request") or return ("return")."""
    return f"{parent_id}/loan/{loan_id}/{verb}"


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
class Expected:
    """What `ResultWaiter.expect` noted before publishing: the events, and for each partition of the results
    topic they will be answered in, its end then (every later result is at or past it)."""
    events: tuple[dict, ...]
    starts: dict[int, int]
    partitions: dict[int, int]  # index in `events` -> results partition


class ResultWaiter:
    """The results of events this caller publishes, read_committed from settlement-results.

        waiter = ResultWaiter(config, results_topic="settlement-results")
        expected = waiter.expect([event])      # before publishing: notes where the results will be
        producer.publish(event); producer.flush()
        [result] = waiter.wait(expected, timeout_s=10)

    The processor writes the result of an event of input partition p to partition p of the results topic
    (p: murmur2 of the parent id, `input_partitions` partitions, by default as many as the results topic
    has: the topic spec gives them one count). `expect` notes the end of those partitions before the events
    are published, so each result is at or past it; `wait` reads from there and matches a result to its
    event by parent id, event id and idempotency key (the processor's own tick results never match). One
    waiter per thread; `close` it when done."""

    def __init__(self, client_config: dict, *, results_topic: str = RESULTS_TOPIC,
                 input_partitions: int | None = None, codec: Codec | None = None) -> None:
        self.results_topic = results_topic
        self.codec = codec or default_codec()
        self._consumer = Consumer({**client_config, "group.id": f"settle-result-waiter-{uuid.uuid4()}",
                                   "isolation.level": "read_committed", "enable.auto.commit": False,
                                   "fetch.wait.max.ms": 100})
        self._input_partitions = input_partitions

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> ResultWaiter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _partition_count(self) -> int:
        if self._input_partitions is None:
            try:
                topic = self._consumer.list_topics(self.results_topic, timeout=10).topics.get(self.results_topic)
            except KafkaException as exc:
                raise KafkaFailure.wrap(f"reading the metadata of {self.results_topic}", exc) from exc
            if topic is None or topic.error is not None or not topic.partitions:
                raise KafkaFailure(f"topic {self.results_topic} is not available: "
                                   f"{topic.error if topic else 'missing'}")
            self._input_partitions = len(topic.partitions)
        return self._input_partitions

    def expect(self, events: list[dict]) -> Expected:
        """Note where the results of `events` (canonical or JSON form, each with its event_id) will be:
        call it before publishing them."""
        ids = [(e["parent_id"], e["event_id"], e["idempotency_key"]) for e in events]
        if len(set(ids)) != len(ids):
            raise ConfigError("ResultWaiter.expect: two of the events have the same parent, event id and "
                              "idempotency key: their results could not be told apart")
        count = self._partition_count()
        partitions = {i: partition_of(event["parent_id"], count) for i, event in enumerate(events)}
        starts = {}
        for partition in sorted(set(partitions.values())):
            try:
                starts[partition] = high_watermark(self._consumer, TopicPartition(self.results_topic, partition))
            except KafkaException as exc:
                raise KafkaFailure.wrap(f"reading the end of {self.results_topic}[{partition}]", exc) from exc
        return Expected(tuple(events), starts, partitions)

    def wait(self, expected: Expected, timeout_s: float = 30.0) -> list[SettlementResult]:
        """The result of each expected event, in their order. ResultTimeout, naming the events still without
        one, when they did not all come within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        wanted = {(e["parent_id"], e["event_id"], e["idempotency_key"]): i for i, e in enumerate(expected.events)}
        found: dict[int, SettlementResult] = {}
        self._consumer.assign([TopicPartition(self.results_topic, p, offset) for p, offset in expected.starts.items()])
        reached: dict[int, int] = dict(expected.starts)
        try:
            while len(found) < len(wanted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout(expected, found, reached, timeout_s)
                for message in self._consumer.consume(num_messages=500, timeout=min(remaining, 0.2)):
                    err = message.error()
                    if err is not None:
                        if err.fatal():
                            raise KafkaFailure(f"reading {self.results_topic}: {err.str()} ({err.name()})",
                                               code=err.name(), fatal=True)
                        continue
                    reached[message.partition()] = message.offset() + 1
                    try:
                        result = decode_output(message.value(), codec=self.codec, source=Source(
                            message.topic(), message.partition(), message.offset()))
                    except UndecodableOutput:
                        continue  # not a result this client reads: never one of its events
                    if not isinstance(result, SettlementResult) or result.is_processor_tick:
                        continue
                    index = wanted.get((result.parent_id, result.event_id, result.idempotency_key))
                    if index is not None and index not in found \
                            and result.input_partition == expected.partitions[index]:
                        found[index] = result
        finally:
            self._consumer.unassign()
        return [found[i] for i in range(len(expected.events))]

    def _timeout(self, expected: Expected, found: dict, reached: dict, timeout_s: float) -> ResultTimeout:
        pending = [event for i, event in enumerate(expected.events) if i not in found]
        first = pending[0]
        partition = expected.partitions[expected.events.index(first)]
        more = f" (and {len(pending) - 1} more)" if len(pending) > 1 else ""
        return ResultTimeout(
            f"no result for {first['type']} {first['event_id']} (parent {first['parent_id']}, idempotency key "
            f"{first['idempotency_key']!r}){more} on {self.results_topic}[{partition}] within {timeout_s:g} s "
            f"(read from offset {expected.starts[partition]} to {reached[partition]}): it was published; is the "
            "processor (settle run) running and caught up? The result may still come; publishing the event "
            "again is safe (same idempotency key)",
            pending=pending, results=[found[i] for i in sorted(found)])


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
