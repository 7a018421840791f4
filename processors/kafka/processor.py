"""`settle run`: the exactly-once settlement processor.

A consumer-group member on `branch-events`. For each assigned partition it restores the RocksDB projection
from the changelog, then folds the partition's events in order. Outputs and ledger changes stay in memory
until a checkpoint (every `commit_interval_ms` or `commit_events` events) commits them with the input
offsets in one Kafka transaction (processors/kafka/checkpoint.py); only then is RocksDB written.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from processors.errors import InvariantViolation
from processors.kafka.checkpoint import FatalProducerError, ProducerFenced, commit_checkpoint, rewind
from processors.kafka.config import ProcessorConfig
from processors.kafka.metrics import Metrics
from processors.kafka.partition import PartitionTask, open_store
from processors.kafka.restore import restore
from schemas.codec import Codec, CodecError, default_codec

log = logging.getLogger("settle.processor")

CONSUME_BATCH = 500
IDLE_POLL_S = 0.05
FENCE_RETRIES = 4
FENCE_BACKOFF_S = 0.5


class Processor:
    def __init__(self, config: ProcessorConfig, topics: dict[str, str], codec: Codec | None = None,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.topics = topics
        self.codec = codec or default_codec()
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.tasks: dict[int, PartitionTask] = {}
        self.ticks: list[tuple[int, bytes]] = []
        self.events_since_checkpoint = 0
        self.last_checkpoint = time.monotonic()
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.fence_retries = 0

    # -- clients ------------------------------------------------------------------------------------------

    def _new_producer(self) -> Producer:
        cfg = self.config
        producer = Producer({**cfg.client_config(), "transactional.id": cfg.transactional_id,
                             "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                             "transaction.timeout.ms": cfg.transaction_timeout_ms, "compression.type": "lz4"})
        # Fences any earlier producer with this transactional.id and aborts its open transaction.
        producer.init_transactions(cfg.transaction_timeout_ms / 1000)
        log.info("transactional producer ready: transactional.id=%s", cfg.transactional_id)
        return producer

    def _new_consumer(self) -> Consumer:
        cfg = self.config
        return Consumer({**cfg.client_config(), "group.id": cfg.group_id, "isolation.level": "read_committed",
                         "enable.auto.commit": False, "enable.auto.offset.store": False,
                         "auto.offset.reset": "earliest", "session.timeout.ms": cfg.session_timeout_ms,
                         "max.poll.interval.ms": cfg.max_poll_interval_ms,
                         "heartbeat.interval.ms": max(cfg.session_timeout_ms // 5, 100)})

    # -- rebalance callbacks ------------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The committed offsets first (stable: a pending transaction's offsets are waited for), then the
        # changelog up to its end: everything those offsets cover is in the projection before folding.
        committed = consumer.committed(partitions, timeout=max(self.config.session_timeout_ms / 1000, 30))
        stores = {tp.partition: open_store(self.config.state_dir, self.config.group_id, tp.partition)
                  for tp in committed}
        restore(stores, self.config.client_config(), self.topics["ledger-changelog"], self.config.group_id,
                progress=lambda p, n: self.metrics.restore_records.labels(str(p)).set(n))
        for tp in committed:
            position = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            self.tasks[tp.partition] = PartitionTask(tp.partition, stores[tp.partition], self.codec, position)
            self.metrics.stopped.labels(str(tp.partition)).set(0)
        log.info("assigned partitions %s", sorted(tp.partition for tp in partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = sorted(tp.partition for tp in partitions)
        if any(task.has_work() for task in self.tasks.values()):
            self.checkpoint()  # commit what was folded before giving the partitions away
        for p in revoked:
            task = self.tasks.pop(p, None)
            if task is not None:
                task.discard()
                task.close()
        log.info("revoked partitions %s", revoked)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Another member owns them already: nothing may be committed for them.
        for tp in partitions:
            task = self.tasks.pop(tp.partition, None)
            if task is not None:
                task.discard()
                task.close()
        log.warning("lost partitions %s (session expired): uncommitted work discarded",
                    sorted(tp.partition for tp in partitions))

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool]) -> None:
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
        self.producer = self._new_producer()
        self.consumer = self._new_consumer()
        self.consumer.subscribe([self.topics["branch-events"]], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)
        log.info("processor running: group %s, input %s", self.config.group_id, self.topics["branch-events"])
        try:
            while not should_stop():
                self.step()
            log.info("stopping: committing the last checkpoint")
            if any(task.has_work() for task in self.tasks.values()):
                self.checkpoint()
        finally:
            self.consumer.close()  # leaves the group (revoke commits nothing more: all committed)
            for task in self.tasks.values():
                task.close()
            self.tasks.clear()
            self.producer.flush(5)

    def step(self) -> None:
        messages = self.consumer.consume(num_messages=CONSUME_BATCH, timeout=IDLE_POLL_S)
        for message in messages:
            self._fold(message)
        self._schedule_ticks()
        if self._checkpoint_due():
            self.checkpoint()

    def _fold(self, message) -> None:
        err = message.error()
        if err is not None:
            if err.fatal():
                raise KafkaException(err)
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer: %s (%s)", err.str(), err.name())
            return
        task = self.tasks.get(message.partition())
        if task is None or task.stopped:
            return
        try:
            event = self.codec.decode_event(message.value() or b"")
        except CodecError as exc:
            task.dead_letters.append((message.key(), {
                "source_topic": message.topic(), "partition": message.partition(), "offset": message.offset(),
                "original": message.value() or b"", "reason": str(exc), "line": None, "event_id": None}))
            self.metrics.dead_letters.inc()
        else:
            try:
                result = task.fold.apply(event, message.offset(), task.out)
            except InvariantViolation as violation:
                self._stop_partition(task, violation)
                return
            self.metrics.events.labels(result["result"]).inc()
        task.position = message.offset() + 1
        self.events_since_checkpoint += 1

    def _stop_partition(self, task: PartitionTask, violation: InvariantViolation) -> None:
        """A bug, not bad input: stop this partition (the others go on), keep its committed state, say so."""
        task.discard()
        task.stopped = str(violation)
        tp = TopicPartition(self.topics["branch-events"], task.partition)
        self.consumer.pause([tp])
        self.metrics.stopped.labels(str(task.partition)).set(1)
        log.critical("PARTITION %d STOPPED: %s. Its committed offset and ledger are untouched; the input is "
                     "kept. Do not repair with a release: fix the fold and restart.", task.partition, violation)

    def _schedule_ticks(self) -> None:
        interval = self.config.tick_interval_ms
        if not interval:
            return
        now_ms = int(self.clock() * 1000)
        for task in self.tasks.values():
            if task.stopped or now_ms - task.last_tick_ms < interval:
                continue
            task.last_tick_ms = now_ms
            tick = {"type": "Tick", "event_id": f"tick-{task.partition}-{now_ms}",
                    "idempotency_key": f"tick/{task.partition}/{now_ms}", "parent_id": "",
                    "occurred_at_ms": now_ms, "now_ms": now_ms}
            self.ticks.append((task.partition, self.codec.encode_event(tick)))

    def _checkpoint_due(self) -> bool:
        if not self.ticks and not any(task.has_work() for task in self.tasks.values()):
            return False
        if self.events_since_checkpoint >= self.config.commit_events:
            return True
        return (time.monotonic() - self.last_checkpoint) * 1000 >= self.config.commit_interval_ms

    def checkpoint(self) -> bool:
        started = time.monotonic()
        tasks = [task for task in self.tasks.values() if not task.stopped]
        try:
            result = commit_checkpoint(self.producer, self.consumer, tasks, self.ticks, self.topics, self.codec,
                                       self.config.transaction_timeout_ms / 1000)
        except ProducerFenced as exc:
            self._recover_from_fence(exc)
            rewind(self.consumer, tasks, self.topics)
            result = None
        except FatalProducerError as exc:
            log.error("%s: recreating the producer and replaying from the last commit", exc)
            self.producer = self._new_producer()
            rewind(self.consumer, tasks, self.topics)
            result = None
        self.ticks.clear()
        self.events_since_checkpoint = 0
        self.last_checkpoint = time.monotonic()
        committed = bool(result and result.committed)
        self.metrics.transactions.labels("committed" if committed else "aborted").inc()
        self.metrics.checkpoint_seconds.set(time.monotonic() - started)
        if committed:
            self.fence_retries = 0
            self._update_gauges()
            log.debug("checkpoint committed: %d events, %d records, %.1f ms", result.events, result.records,
                      (time.monotonic() - started) * 1000)
        return committed

    def _recover_from_fence(self, exc: ProducerFenced) -> None:
        """Fenced: either another process runs with this worker slot (a misconfiguration: it owns the slot
        now), or the broker fenced a fresh producer spuriously while aborting its crashed predecessor's open
        transaction (seen with librdkafka 2.x on Kafka 4.x right after a restart). Recreating the producer,
        after a pause, resolves the second; if the fence persists, the first is the case: stop."""
        self.fence_retries += 1
        if self.fence_retries > FENCE_RETRIES:
            raise exc
        pause_s = FENCE_BACKOFF_S * 2 ** (self.fence_retries - 1)
        log.warning("%s; recreating the producer in %.1f s (attempt %d of %d). If this repeats, another worker "
                    "runs with worker slot %r.", exc, pause_s, self.fence_retries, FENCE_RETRIES,
                    self.config.worker_slot)
        time.sleep(pause_s)
        self.producer = self._new_producer()

    def _update_gauges(self) -> None:
        totals: dict[tuple[str, str], int] = {}
        for task in self.tasks.values():
            for key, value in task.capacity.items():
                totals[key] = totals.get(key, 0) + value
            tp = TopicPartition(self.topics["branch-events"], task.partition)
            try:
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            except KafkaException:
                continue
            if high >= 0 and task.committed_position >= 0:
                self.metrics.lag.labels(str(task.partition)).set(max(high - task.committed_position, 0))
        for (term, dim), value in totals.items():
            self.metrics.capacity.labels(term, dim).set(value)
