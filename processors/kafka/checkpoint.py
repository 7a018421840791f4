"""The commit sequence. Everything the processor makes durable goes through `commit_checkpoint`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from processors.kafka import faults
from processors.kafka.errors import KafkaFailure
from processors.kafka.partition import PartitionTask
from schemas.codec import Codec

log = logging.getLogger("settle.checkpoint")

# Output record lists of `Outputs`, the topic (logical name) each goes to, and its Avro record name.
OUTPUT_ROUTES = (
    ("results", "settlement-results", "SettlementResult"),
    ("releases", "capacity-releases", "CapacityReleased"),
    ("settled", "capacity-releases", "ParentSettled"),
    ("audits", "settlement-audit", "AuditRecord"),
)
COMMIT_RETRIES = 5
FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED} |
                         ({KafkaError.INVALID_PRODUCER_EPOCH} if hasattr(KafkaError, "INVALID_PRODUCER_EPOCH") else set()))


class ProducerFenced(KafkaFailure):
    """Another process started with this worker's transactional.id: it owns the slot now. Raised by the
    checkpoint; the processor stops without committing anything more. Operator: give every worker its own
    worker_slot (SETTLE_WORKER_SLOT); two processes with one slot fence each other."""


class FatalProducerError(KafkaFailure):
    """librdkafka declared the transactional producer unusable. Raised by the checkpoint after the work was
    discarded; the processor recreates its producer and restores. Operator: read the error code."""


@dataclass
class CheckpointResult:
    committed: bool
    events: int = 0
    records: int = 0


def _kafka_error(exc: KafkaException) -> KafkaError | None:
    err = exc.args[0] if exc.args else None
    return err if isinstance(err, KafkaError) else None


def commit_checkpoint(producer: Producer, consumer, tasks: list[PartitionTask], ticks: list[tuple[int, bytes]],
                      topics: dict[str, str], codec: Codec, timeout_s: float) -> CheckpointResult:
    """Make the work buffered since the last checkpoint durable, exactly once, in this order:

    1. begin a transaction;
    2. produce every buffered output of every owned partition (results, releases and parent summaries,
       audit records, dead letters) to the same partition number of its topic, the ledger changelog
       (the view's encoded changes) to the same partition of `ledger-changelog`, and the due ticks to
       the input topic;
    3. flush, then send the input offsets with the consumer's group metadata (KIP-447: a zombie of an
       older group generation is fenced here);
    4. commit the transaction (retried while librdkafka says the commit is retriable);
    5. only then write each partition's RocksDB batch together with the offset of its last changelog
       record, and forget the buffers.

    On an error that requires an abort: abort, discard every partition's uncommitted work and rewind the
    consumer to the committed offsets; the caller goes on (returns committed=False). A fenced producer
    raises ProducerFenced; an unusable one FatalProducerError (both after discarding the work).
    """
    changes = {task.partition: task.view.changes() for task in tasks}
    changelog_offsets: dict[int, int] = {}
    failures: list[KafkaError] = []

    def delivered(err, msg) -> None:
        if err is not None:
            failures.append(err)
        elif msg.topic() == topics["ledger-changelog"]:
            p = msg.partition()
            changelog_offsets[p] = max(changelog_offsets.get(p, -1), msg.offset())

    offsets = [TopicPartition(topics["branch-events"], t.partition, t.position) for t in tasks
               if t.position is not None]
    records = 0
    try:
        producer.begin_transaction()
        for task in tasks:
            records += _produce_outputs(producer, task, topics, codec, changes[task.partition], delivered)
        for partition, value in ticks:
            _produce(producer, topics["branch-events"], partition, None, value, delivered)
        records += len(ticks)
        faults.crash_point("after_produce")
        producer.flush(timeout_s)
        if failures:
            raise KafkaException(failures[0])
        if offsets:
            producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), timeout_s)
        faults.crash_point("after_send_offsets")
        _commit(producer, timeout_s)
    except KafkaException as exc:
        _abort(producer, consumer, tasks, topics, exc, timeout_s)
        return CheckpointResult(committed=False)
    faults.crash_point("after_commit")
    events = 0
    for task in tasks:
        events += len(task.out.results)
        task_changes = changes[task.partition]
        if task_changes and task.partition not in changelog_offsets:
            raise KafkaFailure(f"partition {task.partition}: changelog committed without delivery reports")
        task.committed(task_changes, changelog_offsets.get(task.partition))
    return CheckpointResult(committed=True, events=events, records=records)


def _produce(producer: Producer, topic: str, partition: int, key: bytes | None, value: bytes | None,
             on_delivery) -> None:
    while True:
        try:
            producer.produce(topic, value=value, key=key, partition=partition, on_delivery=on_delivery)
            return
        except BufferError:
            producer.poll(0.05)  # the local queue is full: let deliveries drain


def _produce_outputs(producer: Producer, task: PartitionTask, topics: dict[str, str], codec: Codec,
                     changes: list, delivered) -> int:
    p = task.partition
    count = 0
    for attr, topic, record_name in OUTPUT_ROUTES:
        for record in getattr(task.out, attr):
            _produce(producer, topics[topic], p, record["parent_id"].encode(), codec.encode(record_name, record),
                     delivered)
            count += 1
    for key, letter in task.dead_letters:
        _produce(producer, topics["branch-events-dlq"], p, key, codec.encode("DeadLetter", letter), delivered)
        count += 1
    for key, value in changes:
        _produce(producer, topics["ledger-changelog"], p, key, value, delivered)
        count += 1
    return count


def _commit(producer: Producer, timeout_s: float) -> None:
    for attempt in range(COMMIT_RETRIES):
        try:
            producer.commit_transaction(timeout_s)
            return
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is None or not err.retriable() or attempt == COMMIT_RETRIES - 1:
                raise
            log.warning("commit_transaction retriable error, retrying: %s", err.str())


def _abort(producer: Producer, consumer, tasks: list[PartitionTask], topics: dict[str, str],
           exc: KafkaException, timeout_s: float) -> None:
    err = _kafka_error(exc)
    for task in tasks:
        task.discard()
    if err is not None and (err.code() in FENCED_CODES):
        raise ProducerFenced(f"transactional producer fenced: {err.str()} ({err.name()})", code=err.name(),
                             fatal=True) from exc
    if err is not None and err.fatal():
        raise FatalProducerError(f"transactional producer failed: {err.str()} ({err.name()})", code=err.name(),
                                 fatal=True) from exc
    log.warning("checkpoint aborted, work since the last commit discarded and replayed: %s",
                err.str() if err else exc)
    try:
        producer.abort_transaction(timeout_s)
    except KafkaException as abort_exc:
        abort_err = _kafka_error(abort_exc)
        if abort_err is not None and abort_err.fatal():
            raise FatalProducerError(f"abort failed: {abort_err.str()}", code=abort_err.name(), fatal=True) from exc
        log.warning("abort_transaction: %s", abort_exc)
    rewind(consumer, tasks, topics)


def rewind(consumer, tasks: list[PartitionTask], topics: dict[str, str]) -> None:
    """Seek every owned, running partition back to its last committed offset."""
    for task in tasks:
        if task.stopped:
            continue
        try:
            consumer.seek(TopicPartition(topics["branch-events"], task.partition, task.committed_position))
        except KafkaException as exc:
            # Not fetching yet (just assigned): it will start from the committed offset anyway.
            log.debug("seek partition %d: %s", task.partition, exc)
