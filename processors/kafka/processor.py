"""`settle run`: the exactly-once settlement processor.

A consumer-group member on `branch-events`. For each assigned partition it restores the RocksDB projection
from the changelog, then folds the partition's events in order. Ledger changes stay in memory until a checkpoint
(every `commit_interval_ms` or `commit_events` events) commits them, the outputs and the input offsets in one Kafka
transaction (processors/kafka/checkpoint.py); only then is RocksDB written. The outputs go into that transaction
as each consumed batch is folded: nothing is readable before the commit.

This module holds the loop and the class that composes the rest: its clients (processor_clients.py), taking
over partitions (assignment.py) and giving them back (rebalance.py), inputs the fold cannot take
(fold_failures.py), its ticks (ticks.py), recovery from a failed checkpoint (recovery.py), its metrics
(reporting.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from branch_settlement.processors import gc_tuning
from branch_settlement.processors.kafka import direct_produce, rebalance
from branch_settlement.processors.kafka.assignment import committed_offsets, input_partition_count, load_tasks
from branch_settlement.processors.kafka.checkpoint import Transaction, commit_checkpoint, produce_folded
from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.errors import KafkaFailure, RecordTooLarge
from branch_settlement.processors.kafka.fold_failures import dead_letter, stop_partition
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.processors.kafka.processor_clients import call_timeout_s, new_consumer, new_producer
from branch_settlement.processors.kafka.recovery import recover
from branch_settlement.processors.kafka.reporting import (EventCounters, client_statistics, record_checkpoint,
                                                          record_commit, track_partitions, update_gauges)
from branch_settlement.processors.kafka.stability import StabilityWatch, stall_threshold_s
from branch_settlement.processors.kafka.ticks import schedule_ticks
from branch_settlement.projections import view
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import HEADER_SIZE, Codec, CodecError, default_codec
from branch_settlement.schemas.limits import MAX_EVENT_BYTES
from branch_settlement.schemas.registry import SINGLE_OBJECT_MARKER

if TYPE_CHECKING:
    from confluent_kafka import Consumer, Producer

log = logging.getLogger("settle.processor")

CONSUME_BATCH = 500
IDLE_POLL_S = 0.05


class Processor:
    """One group member: its clients, its partitions' tasks, the loop. The modules it composes get the instance
    and call back through it (`_new_producer`, `_subscribe`, `_load_partitions`, `checkpoint`), so what the
    simulation (faults/sim.py) and the profile (bench/profile_processor.py) replace on an instance applies
    everywhere."""

    def __init__(self, config: ProcessorConfig, topics: dict[str, str], codec: Codec | None = None,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.topics = topics
        view.set_cache_budget(config.view_cache_mb * 1024 * 1024)
        self.codec = codec or default_codec()
        self.metrics = metrics or Metrics()
        # librdkafka's statistics, for the group consumer alone (never the shared settings).
        self.statistics = client_statistics(config, self.metrics, topics["branch-events"])
        self.clock = clock
        self.tasks: dict[int, PartitionTask] = {}
        self.input_partitions: int | None = None  # the input topic's partition count, from its metadata
        self.events_since_checkpoint = 0
        # Start of the last checkpoint: the next is due commit_interval_ms after it (a fixed period, so the
        # time an event waits for its commit does not grow with the checkpoint's own duration).
        self.last_checkpoint = time.monotonic()
        self.producer: Producer | None = None
        # The checkpoint's transaction once something was produced into it before the checkpoint (produce_folded).
        self.transaction: Transaction | None = None
        self.consumer: Consumer | None = None
        self.fence_retries = 0  # fences since the last commit (recovery.py)
        # After a checkpoint that did not commit, the next asks for a delivery report per record (checkpoint.py).
        self.report_every_record = False
        self.failed = False
        self.lost_at: float | None = None  # when the partitions were lost, until the next assignment
        self._event_counters = EventCounters(self.metrics)
        # The compiled per-message loop (native/src/batch.rs), where the codec's event readers are compiled.
        readers = self.codec.compiled_event_readers()
        self._message_folder = (native.module().MessageFolder(readers, SINGLE_OBJECT_MARKER, HEADER_SIZE,
                                                              MAX_EVENT_BYTES, config.commit_records)
                                if readers else None)
        self.stability = StabilityWatch(lambda: AdminClient(config.client_config()),
                                        stall_threshold_s(config.transaction_timeout_ms), self.metrics.unreadable)

    # -- clients and the group ----------------------------------------------------------------------------

    def _new_producer(self) -> Producer:
        # No statistics for the producer: its transactional calls run on worker threads (txn_guard.bounded),
        # where a flush once failed with SystemError (returned NULL without setting an exception) under a
        # coordinator kill with its stats_cb on. Its queue is read on the loop instead (step).
        return new_producer(self.config)

    def _subscribe(self) -> None:
        self.consumer = new_consumer(self.config, self.statistics)
        self.consumer.subscribe([self.topics["branch-events"]], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        rebalance.on_assign(self, consumer, partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        rebalance.on_revoke(self, consumer, partitions)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        rebalance.on_lost(self, consumer, partitions)

    def _load_partitions(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The committed offsets first (stable: librdkafka waits for pending transactional offsets under
        read_committed), then each projection restored from the changelog until it covers them."""
        load_tasks(self.tasks, self._committed(consumer, partitions), self.config, self.topics, self.codec,
                   self.metrics, self._partition_count(consumer))
        track_partitions(self.metrics, self.tasks.values())

    def _partition_count(self, consumer: Consumer) -> int:
        """The input topic's partition count: an event is folded only in its parent's partition of that many
        (schemas/partitioning.py). It never changes: a change moves parents to other partitions.

        Asked of the producer, never of the group consumer: this runs in the consumer's rebalance callback,
        inside its consume(), and a call of the same client there that enters librdkafka with confluent-kafka's
        call state (list_topics does) clears the outer call's state on return; the next callback that consume()
        serves (a statistics report, a log line) then aborts the process (confluent_kafka.c CallState_get:
        Assertion `cs != NULL'). Decision 20."""
        try:
            count = input_partition_count(self.producer, self.topics["branch-events"])
        except KafkaFailure:
            if self.input_partitions is None:
                raise
            log.warning("no metadata of %s: keeping its %d partitions", self.topics["branch-events"],
                        self.input_partitions)
            return self.input_partitions
        if self.input_partitions is not None and count != self.input_partitions:
            raise KafkaFailure(f"{self.topics['branch-events']} now has {count} partitions, not "
                               f"{self.input_partitions}: its parents moved to other partitions, where they "
                               "have no ledger. A partition count once chosen cannot change (deploy/topics.json)",
                               fatal=True)
        self.input_partitions = count
        return count

    def _committed(self, consumer: Consumer, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return committed_offsets(consumer, partitions, self.config.transaction_timeout_ms)

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool]) -> None:
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
        self.producer = self._new_producer()
        self._subscribe()
        log.info("processor running: group %s, input %s, implementation %s%s", self.config.group_id,
                 self.topics["branch-events"], native.describe(self.codec.implementation),
                 "; records without a delivery report go to librdkafka directly"
                 if direct_produce.direct(self.producer) else "")
        try:
            while not should_stop():
                self.step()
            log.info("stopping: committing the last checkpoint")
            if any(task.has_work() for task in self.tasks.values()):
                self.checkpoint()
        except BaseException:
            # Whatever was not committed stays uncommitted: leaving the group must not commit it.
            self.failed = True
            raise
        finally:
            self.consumer.close()  # leaves the group (revoke commits nothing more: all committed)
            for task in self.tasks.values():
                task.close()
            self.tasks.clear()
            self.stability.close()
            self.producer.flush(5)

    def step(self) -> None:
        rebalance.replace_consumer_if_not_rejoined(self)
        timeout = IDLE_POLL_S
        if self._has_work():  # never wait for input past the checkpoint's due time
            due = self.last_checkpoint + self.config.commit_interval_ms / 1000
            timeout = min(IDLE_POLL_S, max(due - time.monotonic(), 0.0))
        self._fold_batch(self.consumer.consume(num_messages=CONSUME_BATCH, timeout=timeout))
        self.events_since_checkpoint += schedule_ticks(self.tasks.values(), self.config.tick_interval_ms, self.clock,
                                                       self._fold_tick)
        self._event_counters.flush()
        self.stability.poll()
        self.metrics.kafka_queue_messages.set(len(self.producer))
        if self._checkpoint_due():
            self.checkpoint()
        else:
            self._produce_folded()

    def _fold_batch(self, messages: list) -> None:
        """Fold a consumed batch in order: runs of plain messages in the compiled loop where there is one, every
        other message (and all of them without it) in `_fold`. One event may buffer thousands of records (a tick
        rebasing or expiring many leases): checkpoint right after it rather than after the batch. If that
        checkpoint did not commit, the consumer was rewound (or the partitions reloaded), and the rest of this
        batch will be consumed again."""
        folder = self._message_folder if "_fold" not in vars(self) else None  # a simulation replaced _fold
        parts = self._fast_parts() if folder is not None else None
        i, count, commit_records = 0, len(messages), self.config.commit_records
        while i < count:
            if parts:
                i, folded, status, task, failure = folder.fold(messages, i, parts, self._event_counters.pending)
                self.events_since_checkpoint += folded
                if status == folder.FAILED:
                    self._stop_partition(task, failure)
                    parts = self._fast_parts()
                    continue
                if status == folder.FULL:
                    if not self.checkpoint():
                        return
                    parts = self._fast_parts()
                    continue
                if i >= count:
                    return
            task = self._fold(messages[i])
            i += 1
            if task is not None and task.buffered() >= commit_records:
                if not self.checkpoint():
                    return
                parts = self._fast_parts() if folder is not None else None

    def _fast_parts(self) -> dict[int, tuple]:
        """partition -> PartitionTask.fast_parts(), for each task the compiled loop may fold for."""
        parts = {}
        for partition, task in self.tasks.items():
            task_parts = task.fast_parts()
            if task_parts is not None:
                parts[partition] = task_parts
        return parts

    def _fold(self, message) -> PartitionTask | None:
        """Fold one consumed message into its partition's task; that task, or None if nothing was folded."""
        err = message.error()
        if err is not None:
            if err.fatal():
                raise KafkaException(err)
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer: %s (%s)", err.str(), err.name())
            return None
        task = self.tasks.get(message.partition())
        if task is None or task.stopped:
            return None
        offset = message.offset()
        if offset < task.next_offset:
            return None  # already folded since the last commit (redelivered around a rebalance or rewind)
        task.next_offset = offset + 1
        try:
            event = self.codec.decode_event(message.value() or b"")
        except CodecError as exc:
            dead_letter(task, message, offset, exc, self.metrics)
        else:
            try:
                result = task.apply(event, offset)
            except Exception as failure:  # an InvariantViolation, or any other bug in the fold
                self._stop_partition(task, failure)
                return None
            self._event_counters.count(result["result"])
        task.position = offset + 1
        self.events_since_checkpoint += 1
        return task

    def _fold_tick(self, task: PartitionTask, tick: dict) -> None:
        """Fold one of the processor's ticks; a failure of the fold stops its partition, as for an event."""
        try:
            task.fold_tick(tick)
        except Exception as failure:  # an InvariantViolation in a timer it fired, or any other bug
            self._stop_partition(task, failure)

    def _stop_partition(self, task: PartitionTask, failure: Exception) -> None:
        self.spoil_transaction({task.partition}, "stopped")
        stop_partition(task, failure, self.consumer, self.topics["branch-events"], self.metrics)

    def spoil_transaction(self, partitions: set[int], what: str) -> None:
        """The work of `partitions` is being discarded: if the open transaction holds records of theirs, it must
        not commit. The next checkpoint aborts it and rewinds every partition (recovery.py)."""
        txn = self.transaction
        if txn is not None and txn.partitions & partitions:
            txn.spoil(f"partitions {sorted(txn.partitions & partitions)} {what} with outputs in the open "
                      "transaction")

    def _produce_folded(self) -> None:
        """Hand what was folded to librdkafka now, into the checkpoint's transaction (checkpoint.Transaction). Not
        after a checkpoint that did not commit: the next produces every record itself, each with a report."""
        if self.report_every_record:
            return
        tasks = [task for task in self.tasks.values() if task.produced < len(task.records) and not task.stopped]
        if not tasks:
            return
        if self.transaction is None:
            self.transaction = Transaction(self.producer, self.tasks, self.topics)
        try:
            produce_folded(self.transaction, tasks, self.topics)
        except KafkaException as exc:  # a record refused, or a producer that cannot begin a transaction
            self.transaction.spoil(exc)
            self.checkpoint()

    def _has_work(self) -> bool:
        return any(task.has_work() for task in self.tasks.values())

    def _checkpoint_due(self) -> bool:
        if self.transaction is not None and self.transaction.spoiled is not None:
            return True  # to abort it
        if not self._has_work():
            return False
        if self.events_since_checkpoint >= self.config.commit_events:
            return True
        if sum(task.buffered() for task in self.tasks.values()) >= self.config.commit_records:
            return True
        return (time.monotonic() - self.last_checkpoint) * 1000 >= self.config.commit_interval_ms

    def checkpoint(self) -> bool:
        """Commit the running partitions' work (their ticks included) in one transaction; whether it
        committed. A checkpoint that did not commit has recovered already (recovery.py), or raised."""
        started = time.monotonic()
        tasks = [task for task in self.tasks.values() if not task.stopped]
        transaction, self.transaction = self.transaction, None
        try:
            result = commit_checkpoint(self.producer, self.consumer, tasks, self.topics, call_timeout_s(self.config),
                                       self.report_every_record, transaction)
        except KafkaFailure as exc:
            recover(self, exc, tasks)
            result = None
        for task in tasks:
            # (a reload replaced the tasks: the failed one is closed, its successor will fail alike and be stopped)
            if task.too_large is not None and self.tasks.get(task.partition) is task:
                # it would fail every checkpoint again: stop it, the others go on
                stop_partition(task, RecordTooLarge(f"{task.too_large}; the checkpoint was aborted"),
                               self.consumer, self.topics["branch-events"], self.metrics,
                               remedy="Raise that setting to at least the record's size and restart.")
                task.too_large = None
        self.events_since_checkpoint = 0
        self.last_checkpoint = started
        committed = bool(result and result.committed)
        self.report_every_record = not committed
        elapsed = time.monotonic() - started
        record_checkpoint(self.metrics, committed, elapsed)
        if committed:
            record_commit(self.metrics, result)
            self.fence_retries = 0
            self.stability.committed(result.last_offsets)
            gc_tuning.after_checkpoint()
            update_gauges(self.metrics, self.tasks.values(), self.consumer, self.topics["branch-events"])
            log.debug("checkpoint committed: %d events, %d records, %.1f ms (%s)", result.events, result.records,
                      elapsed * 1000, result.describe_phases())
        return committed
