"""The commit sequence. Everything the processor makes durable goes through `commit_checkpoint`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from branch_settlement.processors.kafka import direct_produce, faults
from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.processors.kafka.partition import INPUT_POSITION_KEY, PartitionTask
from branch_settlement.processors.ledger.outputs import OUTPUT_TOPICS
from branch_settlement.processors.kafka.txn_guard import bounded
from branch_settlement.schemas import native
from branch_settlement.processors.kafka.errors import TransactionCallStuck
from branch_settlement.processors.kafka.errors import CommitOutcomeUnknown, FatalProducerError, ProducerFenced

log = logging.getLogger("settle.checkpoint")

COMMIT_RETRIES = 5
FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED} |
                         ({KafkaError.INVALID_PRODUCER_EPOCH} if hasattr(KafkaError, "INVALID_PRODUCER_EPOCH") else set()))


@dataclass
class CheckpointResult:
    committed: bool
    events: int = 0
    records: int = 0
    released: dict = field(default_factory=dict)  # (dimension, destination) -> quantity committed
    phases_ms: dict = field(default_factory=dict)  # step of the sequence -> milliseconds it took
    # (topic, partition) -> offset of the last record committed there: the stability watch checks that
    # read_committed consumers can read past it.
    last_offsets: dict = field(default_factory=dict)

    def describe_phases(self) -> str:
        return ", ".join(f"{step} {ms:.1f}" for step, ms in self.phases_ms.items())


def _kafka_error(exc: KafkaException) -> KafkaError | None:
    err = exc.args[0] if exc.args else None
    return err if isinstance(err, KafkaError) else None


def encode_checkpoint(tasks: list[PartitionTask], topics: dict[str, str]) -> tuple[int, dict[int, list]]:
    """Each partition's ledger changes, encoded before the transaction begins (so an encoding failure can
    never leave a transaction open; the outputs were encoded as they were folded), and how many records the
    checkpoint will produce."""
    changes: dict[int, list] = {}
    count = 0
    for task in tasks:
        task_changes = task.fold.changes()
        if task.position is not None:
            # The input position travels with the ledger: a restore knows how far the changelog must go.
            task_changes.append((INPUT_POSITION_KEY, b"%d" % task.position))
        changes[task.partition] = task_changes
        count += len(task.records) + len(task_changes)
    return count, changes


class Transaction:
    """A checkpoint's Kafka transaction, from its first record to its commit or abort. The processor produces
    each consumed batch's outputs into it as soon as they are folded (`produce_folded`: librdkafka sends them
    while the next events fold, so the checkpoint's flush waits for less); the checkpoint produces the rest, the
    ledger changes, sends the offsets and commits. Nothing is readable before the commit (read_committed), and an
    abort takes every record along. Records of a partition whose work is discarded before the commit (a stopped
    or lost partition) cannot be taken out of it: `spoil` says so, and the checkpoint aborts instead."""

    def __init__(self, producer: Producer, tasks: dict[int, PartitionTask], topics: dict[str, str]) -> None:
        self.producer = producer
        self.tasks = tasks  # partition -> task: whose records a delivery report is about
        self.changelog = topics["ledger-changelog"]
        self.begun = False
        self.partitions: set[int] = set()  # of the records produced before the checkpoint
        self.spoiled: KafkaException | None = None
        self.failures: list[KafkaError] = []
        self.changelog_offsets: dict[int, int] = {}
        # (topic, partition) -> offset of the last record delivered there (CheckpointResult.last_offsets)
        self.last_offsets: dict[tuple[str, int], int] = {}

    def begin(self) -> None:
        if not self.begun:
            self.producer.begin_transaction()
            self.begun = True

    def spoil(self, reason: str | KafkaException) -> None:
        """Some of this transaction's records must never be committed: the checkpoint aborts it (the first
        reason given is the one told)."""
        if self.spoiled is None:
            self.spoiled = (reason if isinstance(reason, KafkaException)
                            else KafkaException(KafkaError(KafkaError._STATE, reason)))

    def delivered(self, err, msg) -> None:
        if err is not None:
            self.failures.append(err)
            task = self.tasks.get(msg.partition())
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and task is not None:
                task.too_large = (f"the broker refused a record of {len(msg.value() or b'')} bytes for "
                                  f"{msg.topic()}[{msg.partition()}] as too large ({err.str()}): the "
                                  "topic's max.message.bytes is below what the processor writes")
            return
        topic, p, offset = msg.topic(), msg.partition(), msg.offset()
        self.last_offsets[(topic, p)] = offset
        if topic == self.changelog:
            self.changelog_offsets[p] = max(self.changelog_offsets.get(p, -1), offset)


def produce_folded(transaction: Transaction, tasks: list[PartitionTask], topics: dict[str, str]) -> None:
    """Produce what `tasks` folded since their records were last produced, into `transaction` (begun here if it
    was not), with a delivery report for the last record of each topic. A record refused raises, as in a
    checkpoint; the caller spoils the transaction."""
    calls = _produce_calls(transaction.producer)
    for task in tasks:
        start = task.produced
        if start == len(task.records):
            continue
        transaction.begin()
        transaction.partitions.add(task.partition)
        task.produced = len(task.records)
        _produce_outputs(transaction.producer, task, task.records[start:], topics, transaction.delivered, False,
                         calls)


def _produce_all(producer: Producer, tasks: list[PartitionTask], changes: dict[int, list],
                 topics: dict[str, str], on_delivery, report_every_record: bool = False) -> None:
    """Every record of the checkpoint not produced yet: each partition's outputs and ticks (in input order) then its
    ledger changes.

    One delivery report per topic-partition: its last record's. The changelog's gives the offset the
    projection is written with (a partition's records are delivered in order); all of them tell the
    stability watch how far read_committed consumers must be able to read. A record that fails puts the
    transaction in the abortable error state, which sending the offsets or committing reports
    (rd_kafka_commit_transaction: "if any of the outstanding messages fail permanently the current transaction
    will enter the abortable error state and this function will return an abortable error"). A report per
    record cost Python time on every record (docs/benchmarks.md, the checkpoint); after a checkpoint that failed,
    `report_every_record` asks for one per record, so that a record the broker refuses (too large for the
    topic) is told apart from the rest and its partition stopped, instead of the same abort again."""
    changelog = topics["ledger-changelog"]
    calls = _produce_calls(producer)
    produce_records, direct = calls
    for task in tasks:
        p = task.partition
        records = task.records[task.produced:] if task.produced else task.records
        task.produced = len(task.records)
        _produce_outputs(producer, task, records, topics, on_delivery, report_every_record, calls)
        task_changes = changes[p]
        last_change = len(task_changes) - 1
        if produce_records is not None:  # the same calls, from native/src/produce.rs
            reported = None if report_every_record else [last_change] if task_changes else []
            failed = produce_records(producer, task_changes, p, reported, on_delivery, topic=changelog,
                                     direct=direct)
            if failed is not None:
                n, exc = failed
                _refused(task, exc, changelog, p, task_changes[n][1])
            continue
        value = b""
        try:
            for n, (key, value) in enumerate(task_changes):
                _produce(producer, changelog, p, key, value,
                         on_delivery if n == last_change or report_every_record else None)
        except KafkaException as exc:
            _refused(task, exc, changelog, p, value)


def _produce_calls(producer: Producer) -> tuple:
    """The compiled produce loop (native/src/produce.rs; None: the Python loop) and whether it may hand records to
    librdkafka directly (direct_produce.py), looked up once per checkpoint or consumed batch, not per partition."""
    produce_records = native.compiled_function("produce_records")
    return produce_records, produce_records is not None and direct_produce.direct(producer)


def _produce_outputs(producer: Producer, task: PartitionTask, records: list, topics: dict[str, str], on_delivery,
                     report_every_record: bool, calls: tuple) -> None:
    """Produce `records` (some of `task`'s outputs and ticks, in order), with a delivery report for the last of
    each topic, or for each with `report_every_record`. `calls`: _produce_calls."""
    p = task.partition
    produce_records, direct = calls
    if produce_records is not None:  # the same calls, from native/src/produce.rs (which finds the last ones)
        failed = produce_records(producer, records, p, None, on_delivery, topics=topics,
                                 last_of_each_topic=not report_every_record, direct=direct)
        if failed is not None:
            n, exc = failed
            _refused(task, exc, topics[records[n][0]], p, records[n][2])
        return
    last = range(len(records)) if report_every_record else _last_of_each_topic(records)
    target, value = "", b""
    try:
        for n, (topic, key, value) in enumerate(records):
            target = topics[topic]
            _produce(producer, target, p, key, value, on_delivery if n in last else None)
    except KafkaException as exc:
        _refused(task, exc, target, p, value)


def _refused(task: PartitionTask, exc: BaseException, target: str, partition: int, value: bytes | None) -> None:
    """A record's produce raised `exc`: a record too large for the producer stops its partition after the abort
    (`task.too_large`); raise it."""
    err = _kafka_error(exc) if isinstance(exc, KafkaException) else None
    if err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
        task.too_large = (f"a record of {len(value or b'')} bytes for {target}[{partition}] is larger than the "
                          "producer accepts (its message.max.bytes)")
    raise exc


def _last_of_each_topic(records: list) -> set[int]:
    """Indexes of the last record of each topic a partition's records go to (the output topics and
    ledger-ticks; found from the end, so a few steps)."""
    seen: set[str] = set()
    last: set[int] = set()
    for n in range(len(records) - 1, -1, -1):
        topic = records[n][0]
        if topic not in seen:
            seen.add(topic)
            last.add(n)
            if len(seen) == len(OUTPUT_TOPICS) + 1:
                break
    return last


def commit_checkpoint(producer: Producer, consumer, tasks: list[PartitionTask], topics: dict[str, str],
                      timeout_s: float, report_every_record: bool = False,
                      transaction: Transaction | None = None) -> CheckpointResult:
    """Make the work buffered since the last checkpoint durable, exactly once, in this order:

    1. take every output and dead letter (encoded as they were folded, in input order), encode the ledger
       changes (with the partition's next input offset);
    2. begin a transaction, or go on with `transaction`, into which the processor produced outputs as they were
       folded (a spoiled one is aborted instead); produce the rest of the outputs to the same partition number
       of their topics, the ticks to the same partition of `ledger-ticks`, the ledger changes to the same
       partition of `ledger-changelog`;
    3. send the input offsets of every owned partition with the consumer's group metadata (KIP-447: a zombie
       of an older group generation is fenced here, even for a checkpoint of ticks), then flush: any record
       that failed aborts the transaction;
    4. commit the transaction (retried while librdkafka says the commit is retriable);
    5. only then forget the buffers and write each partition's RocksDB batch with the offset of its last
       changelog record. A failing RocksDB write after the commit raises: restore repairs the store.

    Every blocking call (flush, send offsets, commit, abort) has a hard deadline (txn_guard): librdkafka can
    block past its own timeout after a broker restart. A call stuck before the commit is a FatalProducerError
    (the next producer's epoch aborts the transaction); stuck in the commit, the outcome is unknown.

    Before the commit is attempted, an abortable error aborts, discards every partition's uncommitted work
    and rewinds the consumer (returns committed=False); a fenced or unusable producer raises
    ProducerFenced / FatalProducerError after discarding. If the commit was sent and its outcome is not
    known, CommitOutcomeUnknown is raised.
    """
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def phase(step: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[step] = (now - mark) * 1000
        mark = now

    count, changes = encode_checkpoint(tasks, topics)
    phase("encode")
    txn = (transaction if transaction is not None and transaction.producer is producer
           else Transaction(producer, {task.partition: task for task in tasks}, topics))
    offsets = [TopicPartition(topics["branch-events"], t.partition,
                              t.position if t.position is not None else t.committed_position)
               for t in tasks if t.position is not None or t.committed_position >= 0]
    try:
        if txn.spoiled is not None:
            raise txn.spoiled
        txn.begin()
        _produce_all(producer, tasks, changes, topics, txn.delivered, report_every_record)
        phase("produce")
        faults.crash_point("after_produce")
        # The offsets go while librdkafka still delivers the records (to the coordinators, on connections of their
        # own); a record that fails makes the transaction abort all the same, offsets included.
        faults.pause_point("before_send_offsets")
        if offsets:
            bounded("send_offsets_to_transaction", producer.send_offsets_to_transaction, offsets,
                    consumer.consumer_group_metadata(), timeout_s, timeout_s=timeout_s)
        phase("offsets")
        faults.crash_point("after_send_offsets")
        undelivered = bounded("flush", producer.flush, timeout_s, timeout_s=timeout_s)
        phase("flush")
        if txn.failures:
            raise KafkaException(txn.failures[0])
        if undelivered:  # the broker is unreachable: this transaction cannot commit, don't wait on it further
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                            f"{undelivered} records undelivered after {timeout_s:.1f} s"))
    except TransactionCallStuck as exc:
        # Not aborted: an abort would queue behind the stuck call. The next producer's init_transactions
        # aborts the transaction (a new epoch); the stuck one can commit nothing.
        for task in tasks:
            task.discard()
        raise FatalProducerError(f"{exc}: nothing was committed", code=exc.code, retriable=True) from exc
    except KafkaException as exc:
        _abort(producer, consumer, tasks, topics, exc, timeout_s)
        return CheckpointResult(committed=False)
    try:
        _commit(producer, consumer, tasks, topics, timeout_s)
    except _Aborted:
        return CheckpointResult(committed=False)
    phase("commit")
    faults.crash_point("after_commit")
    events = sum(task.results for task in tasks)
    released: dict[tuple[str, str], int] = {}
    for task in tasks:
        task_changes = changes[task.partition]
        if task_changes and task.partition not in txn.changelog_offsets:
            raise KafkaFailure(f"partition {task.partition}: changelog committed without delivery reports")
        for key, quantity in task.forget_committed().items():
            released[key] = released.get(key, 0) + quantity
    for task in tasks:
        task.write_committed(changes[task.partition], txn.changelog_offsets.get(task.partition))
    phase("store")
    return CheckpointResult(committed=True, events=events, records=count, released=released,
                            phases_ms=phases, last_offsets=txn.last_offsets)


def _produce(producer: Producer, topic: str, partition: int, key: bytes | None, value: bytes | None,
             on_delivery) -> None:
    while True:
        try:
            if on_delivery is None:
                producer.produce(topic, value, key, partition)
            else:
                producer.produce(topic, value, key, partition, on_delivery)
            return
        except BufferError:
            producer.poll(0.05)  # the local queue is full: let deliveries drain


def _commit(producer: Producer, consumer, tasks: list[PartitionTask], topics: dict[str, str],
            timeout_s: float) -> None:
    """Commit, retrying what librdkafka calls retriable. An error that requires an abort is aborted; if the
    abort fails too, or the error is anything else, the outcome is unknown."""
    for attempt in range(COMMIT_RETRIES):
        try:
            bounded("commit_transaction", producer.commit_transaction, timeout_s, timeout_s=timeout_s)
            return
        except TransactionCallStuck as exc:
            raise CommitOutcomeUnknown(f"{exc}: the transaction may have committed") from exc
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is not None and err.retriable() and not err.txn_requires_abort() and attempt < COMMIT_RETRIES - 1:
                log.warning("commit_transaction retriable error, retrying: %s", err.str())
                continue
            if err is not None and err.txn_requires_abort():
                try:
                    bounded("abort_transaction", producer.abort_transaction, timeout_s, timeout_s=timeout_s)
                except (KafkaException, TransactionCallStuck) as abort_exc:
                    raise CommitOutcomeUnknown(f"commit failed ({err.str()}) and so did the abort "
                                               f"({abort_exc}): the transaction may have committed") from exc
                log.warning("commit_transaction failed and was aborted: %s", err.str())
                for task in tasks:
                    task.discard()
                rewind(consumer, tasks, topics)
                raise _Aborted() from exc
            raise CommitOutcomeUnknown(f"commit_transaction failed: {exc}") from exc


class _Aborted(Exception):
    """Internal: the commit failed and was aborted cleanly."""


def _abort(producer: Producer, consumer, tasks: list[PartitionTask], topics: dict[str, str],
           exc: KafkaException, timeout_s: float) -> None:
    err = _kafka_error(exc)
    for task in tasks:
        task.discard()
    if err is not None and err.code() in FENCED_CODES:
        raise ProducerFenced(f"transactional producer fenced: {err.str()} ({err.name()})", code=err.name(),
                             fatal=True) from exc
    if err is not None and err.fatal():
        raise FatalProducerError(f"transactional producer failed: {err.str()} ({err.name()})", code=err.name(),
                                 fatal=True) from exc
    if err is not None and err.code() == KafkaError._TIMED_OUT:
        # Seen after a broker restart: the producer's transactional calls keep timing out against a
        # coordinator it no longer finds. Nothing was committed; a new producer (whose init_transactions
        # aborts this transaction) looks the coordinator up afresh.
        raise FatalProducerError(f"transactional call timed out before the commit: {err.str()}", code=err.name(),
                                 retriable=True) from exc
    log.warning("checkpoint aborted, work since the last commit discarded and replayed: %s",
                err.str() if err else exc)
    try:
        bounded("abort_transaction", producer.abort_transaction, timeout_s, timeout_s=timeout_s)
    except TransactionCallStuck as stuck:
        raise FatalProducerError(f"{stuck}: nothing was committed", code=stuck.code, retriable=True) from exc
    except KafkaException as abort_exc:
        abort_err = _kafka_error(abort_exc)
        if abort_err is not None and abort_err.fatal():
            raise FatalProducerError(f"abort failed: {abort_err.str()}", code=abort_err.name(), fatal=True) from exc
        log.warning("abort_transaction: %s", abort_exc)
    rewind(consumer, tasks, topics)


def rewind(consumer, tasks: list[PartitionTask], topics: dict[str, str]) -> None:
    """Seek every owned, running partition back to its last committed offset, those that folded nothing since
    too: the consumer may have fetched their records already, in the batch whose rest is dropped after a
    failed checkpoint (Processor._fold_batch), and without the seek those would never come again. A
    partition that folded since and cannot be rewound would skip the discarded events: that raises (the
    processor then reloads its partitions); one that folded nothing and cannot seek yet (just assigned, not
    fetching) starts from the committed offset anyway."""
    for task in tasks:
        if task.stopped:
            continue
        read = task.next_offset != task.committed_position
        task.next_offset = task.committed_position
        try:
            consumer.seek(TopicPartition(topics["branch-events"], task.partition, task.committed_position))
        except KafkaException as exc:
            if read:
                raise KafkaFailure.wrap(f"rewinding partition {task.partition} to {task.committed_position}",
                                        exc) from exc
            log.debug("partition %d: not rewound (%s): it starts from the committed offset", task.partition, exc)
