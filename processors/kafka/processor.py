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
from confluent_kafka.admin import AdminClient

from branch_settlement.processors import gc_tuning
from branch_settlement.processors.ledger.errors import InvariantViolation
from branch_settlement.processors.kafka.checkpoint import commit_checkpoint, rewind
from branch_settlement.processors.kafka.errors import (CommitOutcomeUnknown, FatalProducerError, KafkaFailure,
                                                       ProducerFenced, TransactionCallStuck)
from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.partition import (PartitionTask, delete_store, input_position, open_store,
                                                          store_path)
from branch_settlement.processors.kafka.restore import restore
from branch_settlement.processors.kafka.stability import StabilityWatch, stall_threshold_s
from branch_settlement.processors.kafka.txn_guard import bounded, check_stuck_budget, stuck_calls
from branch_settlement.projections import view
from branch_settlement.schemas.codec import Codec, CodecError, default_codec

log = logging.getLogger("settle.processor")

CONSUME_BATCH = 500
IDLE_POLL_S = 0.05
FENCE_RETRIES = 4
FENCE_BACKOFF_S = 0.5
TXN_CALL_TIMEOUT_MAX_S = 10.0
REJOIN_MIN_S = 15.0
INIT_ATTEMPTS = 5
INIT_BACKOFF_S = 2.0
COMMITTED_EXTRA_WAIT_S = 30.0  # beyond transaction.timeout.ms: the broker's abort of a timed-out transaction


class Processor:
    def __init__(self, config: ProcessorConfig, topics: dict[str, str], codec: Codec | None = None,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.topics = topics
        view.set_cache_budget(config.view_cache_mb * 1024 * 1024)
        self.codec = codec or default_codec()
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.tasks: dict[int, PartitionTask] = {}
        self.ticks: list[tuple[int, bytes]] = []
        self.events_since_checkpoint = 0
        # Start of the last checkpoint: the next is due commit_interval_ms after it (a fixed period, so the
        # time an event waits for its commit does not grow with the checkpoint's own duration).
        self.last_checkpoint = time.monotonic()
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.fence_retries = 0
        self.failed = False
        self.lost_at: float | None = None  # when the partitions were lost, until the next assignment
        self._event_counters: dict = {}  # result code -> its labelled counter (labels() costs a lock and a lookup)
        self.stability = StabilityWatch(lambda: AdminClient(config.client_config()),
                                        stall_threshold_s(config.transaction_timeout_ms), self.metrics.unreadable)

    # -- clients ------------------------------------------------------------------------------------------

    def _new_producer(self) -> Producer:
        """A transactional producer whose init_transactions fenced every earlier producer with this
        transactional.id and aborted (or completed) its open transaction. Retried while the coordinator is
        unavailable or the call blocks (after a broker restart), up to INIT_ATTEMPTS times."""
        cfg = self.config
        timeout_s = cfg.transaction_timeout_ms / 1000
        for attempt in range(1, INIT_ATTEMPTS + 1):
            check_stuck_budget()
            producer = Producer({**cfg.client_config(), "transactional.id": cfg.transactional_id,
                                 "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                                 "transaction.timeout.ms": cfg.transaction_timeout_ms, "compression.type": "lz4"})
            try:
                bounded("init_transactions", producer.init_transactions, timeout_s, timeout_s=timeout_s)
            except TransactionCallStuck as exc:
                failure: Exception = exc
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if not isinstance(err, KafkaError) or err.fatal() or not (
                        err.retriable() or err.code() == KafkaError._TIMED_OUT):
                    raise
                failure = exc
            else:
                log.info("transactional producer ready: transactional.id=%s", cfg.transactional_id)
                return producer
            if attempt == INIT_ATTEMPTS:
                raise KafkaFailure(f"init_transactions failed {attempt} times, last: {failure}", retriable=True)
            log.warning("init_transactions attempt %d of %d failed (%s); retrying in %.1f s", attempt,
                        INIT_ATTEMPTS, failure, INIT_BACKOFF_S)
            time.sleep(INIT_BACKOFF_S)
        raise AssertionError("unreachable")

    def _new_consumer(self) -> Consumer:
        cfg = self.config
        return Consumer({**cfg.client_config(), "group.id": cfg.group_id, "isolation.level": "read_committed",
                         "enable.auto.commit": False, "enable.auto.offset.store": False,
                         "auto.offset.reset": "earliest", "session.timeout.ms": cfg.session_timeout_ms,
                         "max.poll.interval.ms": cfg.max_poll_interval_ms,
                         "heartbeat.interval.ms": max(cfg.session_timeout_ms // 5, 100)})

    # -- rebalance callbacks ------------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if consumer is not self.consumer:
            return  # a given-up consumer's callback (closed on a thread of its own): nothing of ours
        self.lost_at = None
        self._load_partitions(consumer, partitions)
        log.info("assigned partitions %s", sorted(tp.partition for tp in partitions))

    def _load_partitions(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The committed offsets first (stable: librdkafka waits for pending transactional offsets under
        read_committed), then each projection restored from the changelog until it covers them."""
        committed = self._committed(consumer, partitions)
        stores = {tp.partition: self._open_projection(tp.partition, tp.offset) for tp in committed}
        restore(stores, self.config.client_config(), self.topics["ledger-changelog"], self.config.group_id,
                targets={tp.partition: tp.offset for tp in committed},
                progress=lambda p, n: self.metrics.restore_records.labels(str(p)).set(n))
        for tp in committed:
            position = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            self.tasks[tp.partition] = PartitionTask(tp.partition, stores[tp.partition], self.codec, position)
            self.metrics.stopped.labels(str(tp.partition)).set(0)

    def _open_projection(self, partition: int, committed_offset: int):
        """The partition's RocksDB projection, rebuilt from scratch when it covers input beyond the group's
        committed offset. That happens when a broker loses a transaction its client saw committed (an
        unclean restart before the commit markers were written: docs/faults.md, finding 2): the projection
        was written after the acknowledged commit, the changelog and the offsets were rolled back. The
        changelog is the truth; the restore rebuilds the projection from it."""
        store = open_store(self.config.state_dir, self.config.group_id, partition)
        position = input_position(store)
        if position is None or committed_offset < 0 or position <= committed_offset:
            return store
        path = store_path(self.config.state_dir, self.config.group_id, partition)
        log.error("partition %d: the projection covers input offset %d, beyond the committed offset %d (a "
                  "transaction acknowledged as committed was lost by the broker): rebuilding %s from the "
                  "changelog", partition, position, committed_offset, path)
        store.close()
        delete_store(self.config.state_dir, self.config.group_id, partition)
        self.metrics.projection_rebuilds.inc()
        return open_store(self.config.state_dir, self.config.group_id, partition)

    def _committed(self, consumer: Consumer, partitions: list[TopicPartition]) -> list[TopicPartition]:
        # A crashed predecessor's pending offsets stay unstable until its transaction times out and the
        # broker aborts it: wait for that, not for a fixed 30 s.
        budget_s = self.config.transaction_timeout_ms / 1000 + COMMITTED_EXTRA_WAIT_S
        deadline = time.monotonic() + budget_s
        while True:
            try:
                committed = consumer.committed(partitions, timeout=max(deadline - time.monotonic(), 1))
                break
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if time.monotonic() >= deadline or not (isinstance(err, KafkaError) and err.retriable()
                                                        or getattr(err, "code", lambda: None)() == KafkaError._TIMED_OUT):
                    failure = KafkaFailure.wrap("fetching the committed offsets", exc)
                    if time.monotonic() >= deadline:
                        failure = KafkaFailure(
                            f"{failure}. They stayed unavailable for {budget_s:.0f} s, longer than a crashed "
                            "predecessor's transaction can stay open: most likely a hanging transaction on the "
                            "group's __consumer_offsets partition, which Kafka can leave behind after a broker "
                            "crash (docs/faults.md, finding 2); kafka-transactions.sh find-hanging names it",
                            code=failure.code, retriable=failure.retriable, fatal=failure.fatal)
                    raise failure from exc
                log.warning("committed offsets not available yet (%s); retrying", err)
        for tp in committed:
            if tp.error is not None:
                raise KafkaFailure(f"committed offset of partition {tp.partition}: {tp.error.str()}",
                                   code=tp.error.name())
        return committed

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if consumer is not self.consumer:
            return
        revoked = sorted(tp.partition for tp in partitions)
        if not self.failed and self._has_work():
            self.checkpoint()  # commit what was folded before giving the partitions away
        self.ticks = [(p, tick) for p, tick in self.ticks if p not in revoked]
        for p in revoked:
            task = self.tasks.pop(p, None)
            if task is not None:
                task.discard()
                task.close()
        self._forget_written(revoked)
        log.info("revoked partitions %s", revoked)

    def _forget_written(self, partitions) -> None:
        """The stability watch stops watching what a partition's new owner writes to now."""
        self.stability.forget([(topic, p) for topic in self.topics.values() for p in partitions])

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Another member owns them already: nothing may be committed for them.
        if consumer is not self.consumer:
            return
        self.lost_at = time.monotonic()
        lost = {tp.partition for tp in partitions}
        self.ticks = [(p, tick) for p, tick in self.ticks if p not in lost]
        for tp in partitions:
            task = self.tasks.pop(tp.partition, None)
            if task is not None:
                task.discard()
                task.close()
        self._forget_written(lost)
        log.warning("lost partitions %s (session expired): uncommitted work discarded",
                    sorted(tp.partition for tp in partitions))

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool]) -> None:
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
        self.producer = self._new_producer()
        self._subscribe()
        log.info("processor running: group %s, input %s", self.config.group_id, self.topics["branch-events"])
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

    def _subscribe(self) -> None:
        self.consumer = self._new_consumer()
        self.consumer.subscribe([self.topics["branch-events"]], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)

    def _rejoin_deadline_s(self) -> float:
        return max(REJOIN_MIN_S, 3 * self.config.session_timeout_ms / 1000)

    def _replace_consumer_if_not_rejoined(self) -> None:
        """After its session expired (a broker restart, a network partition) the consumer rejoins the group by
        itself; librdkafka 2.16 sometimes never does (a stale cached group coordinator, librdkafka issue 5511).
        Nothing is owned meanwhile, so nothing is lost by starting over with a new consumer."""
        if self.lost_at is None or time.monotonic() - self.lost_at < self._rejoin_deadline_s():
            return
        log.error("no partitions assigned %.0f s after losing them: replacing the consumer",
                  time.monotonic() - self.lost_at)
        old = self.consumer
        self.metrics.consumer_replacements.inc()
        self._subscribe()
        self.lost_at = time.monotonic()  # the new consumer gets the same time to join
        try:  # leaves the group if it can; its callbacks are ignored (it is no longer self.consumer)
            bounded("consumer.close", old.close, timeout_s=self.config.session_timeout_ms / 1000)
        except TransactionCallStuck:
            log.warning("the replaced consumer did not close; left behind")
        except KafkaException as exc:
            log.warning("closing the replaced consumer: %s", exc)

    def step(self) -> None:
        self._replace_consumer_if_not_rejoined()
        timeout = IDLE_POLL_S
        if self._has_work():  # never wait for input past the checkpoint's due time
            due = self.last_checkpoint + self.config.commit_interval_ms / 1000
            timeout = min(IDLE_POLL_S, max(due - time.monotonic(), 0.0))
        self._fold_batch(self.consumer.consume(num_messages=CONSUME_BATCH, timeout=timeout))
        self._schedule_ticks()
        self.stability.poll()
        if self._checkpoint_due():
            self.checkpoint()

    def _fold_batch(self, messages: list) -> None:
        for message in messages:
            task = self._fold(message)
            # One event may buffer thousands of records (a tick rebasing or expiring many leases): checkpoint
            # right after it rather than after the batch. If that checkpoint did not commit, the consumer was
            # rewound (or the partitions reloaded), and the rest of this batch will be consumed again.
            if task is not None and task.buffered() >= self.config.commit_records and not self.checkpoint():
                return

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
            task.dead_letter(message.key(), {
                "source_topic": message.topic(), "partition": message.partition(), "offset": offset,
                "original": message.value() or b"", "reason": str(exc), "line": None, "event_id": None})
            self.metrics.dead_letters.inc()
        else:
            try:
                result = task.apply(event, offset)
            except Exception as failure:  # an InvariantViolation, or any other bug in the fold
                self._stop_partition(task, failure)
                return None
            code = result["result"]
            counter = self._event_counters.get(code)
            if counter is None:
                counter = self._event_counters[code] = self.metrics.events.labels(code)
            counter.inc()
        task.position = offset + 1
        self.events_since_checkpoint += 1
        return task

    def _stop_partition(self, task: PartitionTask, violation: Exception) -> None:
        """A bug, not bad input: stop this partition (the others go on), keep its committed state, say so.
        Its uncommitted work is discarded, so a half-applied event is never committed."""
        task.discard()
        task.stopped = str(violation)
        tp = TopicPartition(self.topics["branch-events"], task.partition)
        self.consumer.pause([tp])
        self.metrics.stopped.labels(str(task.partition)).set(1)
        log.critical("PARTITION %d STOPPED: %s. Its committed offset and ledger are untouched; the input is "
                     "kept. Do not repair with a release: fix the fold and restart.", task.partition, violation,
                     exc_info=not isinstance(violation, InvariantViolation))

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

    def _has_work(self) -> bool:
        return bool(self.ticks) or any(task.has_work() for task in self.tasks.values())

    def _checkpoint_due(self) -> bool:
        if not self._has_work():
            return False
        if self.events_since_checkpoint >= self.config.commit_events:
            return True
        if sum(task.buffered() for task in self.tasks.values()) >= self.config.commit_records:
            return True
        return (time.monotonic() - self.last_checkpoint) * 1000 >= self.config.commit_interval_ms

    def checkpoint(self) -> bool:
        started = time.monotonic()
        tasks = [task for task in self.tasks.values() if not task.stopped]
        owned = {task.partition for task in tasks}
        ticks = [(p, tick) for p, tick in self.ticks if p in owned]
        try:
            result = commit_checkpoint(self.producer, self.consumer, tasks, ticks, self.topics,
                                       self._call_timeout_s())
        except ProducerFenced as exc:
            self._recover_from_fence(exc)
            self._rewind_or_reload(tasks)
            result = None
        except FatalProducerError as exc:
            log.error("%s: recreating the producer and replaying from the last commit", exc)
            self.producer = self._new_producer()
            self._rewind_or_reload(tasks)
            result = None
        except CommitOutcomeUnknown as exc:
            log.error("%s: reloading every partition from the committed offsets and the changelog", exc)
            self.producer = self._new_producer()  # settles the pending transaction, whichever way it went
            self._reload()
            result = None
        except KafkaFailure as exc:  # a rewind that failed after a clean abort
            log.error("%s: reloading every partition from the committed offsets and the changelog", exc)
            self._reload()
            result = None
        self.ticks.clear()
        self.events_since_checkpoint = 0
        self.last_checkpoint = started
        committed = bool(result and result.committed)
        self.metrics.transactions.labels("committed" if committed else "aborted").inc()
        elapsed = time.monotonic() - started
        self.metrics.checkpoint_seconds.set(elapsed)
        self.metrics.checkpoint_duration.observe(elapsed)
        self.metrics.stuck_calls.set(stuck_calls())
        if committed:
            self.metrics.last_commit.set(time.time())
            self.metrics.checkpoint_events.observe(result.events)
            for (dimension, destination), quantity in result.released.items():
                self.metrics.releases.labels(dimension, destination).inc(quantity)
            self.fence_retries = 0
            self.stability.committed(result.last_offsets)
            gc_tuning.after_checkpoint()
            self._update_gauges()
            log.debug("checkpoint committed: %d events, %d records, %.1f ms (%s)", result.events, result.records,
                      elapsed * 1000, result.describe_phases())
        return committed

    def _call_timeout_s(self) -> float:
        """Per transactional call: short enough that a stuck coordinator is noticed well within the poll
        interval, long enough for a commit on a busy broker."""
        return min(self.config.transaction_timeout_ms / 1000 / 3, TXN_CALL_TIMEOUT_MAX_S)

    def _rewind_or_reload(self, tasks: list[PartitionTask]) -> None:
        try:
            rewind(self.consumer, tasks, self.topics)
        except KafkaFailure as exc:
            log.error("%s: reloading every partition", exc)
            self._reload()

    def _reload(self) -> None:
        """Forget all in-memory state and load the owned partitions again, as on assignment: committed
        offsets, projections restored from the changelog, the consumer moved back to the offsets."""
        # What the group assigns now, not what we held: partitions may have been lost meanwhile.
        partitions = [TopicPartition(tp.topic, tp.partition) for tp in self.consumer.assignment()]
        for task in self.tasks.values():
            task.discard()
            task.close()
        self.tasks.clear()
        self.ticks.clear()
        self._load_partitions(self.consumer, partitions)
        for task in self.tasks.values():
            self.consumer.seek(TopicPartition(self.topics["branch-events"], task.partition, task.committed_position))

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
