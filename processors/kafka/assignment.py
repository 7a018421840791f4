"""Taking over assigned partitions: the group's committed offsets, each partition's projection (rebuilt when
it is ahead of them), restored from the changelog, and the partition tasks built on them.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.partition import (PartitionTask, delete_store, input_position, open_store,
                                                          store_path)
from branch_settlement.processors.kafka.restore import restore
from branch_settlement.schemas.codec import Codec

log = logging.getLogger("settle.processor")

COMMITTED_EXTRA_WAIT_S = 30.0  # beyond transaction.timeout.ms: the broker's abort of a timed-out transaction


def load_tasks(tasks: dict[int, PartitionTask], committed: list[TopicPartition], config: ProcessorConfig,
               topics: dict[str, str], codec: Codec, metrics: Metrics, partitions: int) -> None:
    """Add to `tasks` one task per partition of `committed` (the group's committed offsets), its projection
    restored from the changelog until it covers them."""
    stores = {tp.partition: open_projection(config, tp.partition, tp.offset, metrics) for tp in committed}
    restore(stores, config.client_config(), topics["ledger-changelog"], config.group_id,
            targets={tp.partition: tp.offset for tp in committed},
            progress=lambda p, n: metrics.restore_records.labels(str(p)).set(n))
    for tp in committed:
        position = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
        tasks[tp.partition] = PartitionTask(tp.partition, stores[tp.partition], codec, position, partitions)
        metrics.stopped.labels(str(tp.partition)).set(0)


def input_partition_count(client: Consumer | Producer, topic: str, timeout_s: float = 10.0) -> int:
    """How many partitions the input topic has, from the cluster's metadata (asked of any client)."""
    try:
        metadata = client.list_topics(topic, timeout=timeout_s)
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"metadata of {topic}", exc) from None
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise KafkaFailure(f"metadata of {topic}: {found.error.str() if found and found.error else 'no partitions'}")
    return len(found.partitions)


def open_projection(config: ProcessorConfig, partition: int, committed_offset: int, metrics: Metrics):
    """The partition's RocksDB projection, rebuilt from scratch when it covers input beyond the group's
    committed offset. That happens when a broker loses a transaction its client saw committed (an
    unclean restart before the commit markers were written: docs/faults.md, finding 2): the projection
    was written after the acknowledged commit, the changelog and the offsets were rolled back. The
    changelog is the truth; the restore rebuilds the projection from it."""
    store = open_store(config.state_dir, config.group_id, partition)
    position = input_position(store)
    if position is None or committed_offset < 0 or position <= committed_offset:
        return store
    path = store_path(config.state_dir, config.group_id, partition)
    log.error("partition %d: the projection covers input offset %d, beyond the committed offset %d (a "
              "transaction acknowledged as committed was lost by the broker): rebuilding %s from the "
              "changelog", partition, position, committed_offset, path)
    store.close()
    delete_store(config.state_dir, config.group_id, partition)
    metrics.projection_rebuilds.inc()
    return open_store(config.state_dir, config.group_id, partition)


def committed_offsets(consumer: Consumer, partitions: list[TopicPartition],
                      transaction_timeout_ms: int) -> list[TopicPartition]:
    """The group's committed offsets of `partitions`, stable: librdkafka waits for pending transactional
    offsets under read_committed. A crashed predecessor's pending offsets stay unstable until its
    transaction times out and the broker aborts it, so they are asked for again until then."""
    budget_s = transaction_timeout_ms / 1000 + COMMITTED_EXTRA_WAIT_S
    deadline = time.monotonic() + budget_s
    while True:
        try:
            committed = consumer.committed(partitions, timeout=max(deadline - time.monotonic(), 1))
            break
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if time.monotonic() >= deadline or not _may_pass(err):
                raise _unavailable(exc, budget_s, time.monotonic() >= deadline) from exc
            log.warning("committed offsets not available yet (%s); retrying", err)
    for tp in committed:
        if tp.error is not None:
            raise KafkaFailure(f"committed offset of partition {tp.partition}: {tp.error.str()}",
                               code=tp.error.name())
    return committed


def _may_pass(err) -> bool:
    return (isinstance(err, KafkaError) and err.retriable()
            or getattr(err, "code", lambda: None)() == KafkaError._TIMED_OUT)


def _unavailable(exc: KafkaException, budget_s: float, past_deadline: bool) -> KafkaFailure:
    """The failure to raise. Offsets unavailable for longer than any transaction of a predecessor can stay open
    are not a predecessor's: the message names the likely cause and the tool that finds it."""
    failure = KafkaFailure.wrap("fetching the committed offsets", exc)
    if not past_deadline:
        return failure
    return KafkaFailure(
        f"{failure}. They stayed unavailable for {budget_s:.0f} s, longer than a crashed "
        "predecessor's transaction can stay open: most likely a hanging transaction on the "
        "group's __consumer_offsets partition, which Kafka can leave behind after a broker "
        "crash, or a controlled shutdown of a cluster's only broker during a commit (docs/faults.md, "
        "findings 2 and 7); kafka-transactions.sh find-hanging names it",
        code=failure.code, retriable=failure.retriable, fatal=failure.fatal)
