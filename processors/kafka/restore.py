"""Restore projections from the ledger changelog (read_committed), each from the offset stored with it; a
missing projection (offset -1) is rebuilt from the beginning. All partitions of an assignment are restored
together by one consumer; a partition already at the end of its changelog costs one watermark request."""

from __future__ import annotations

import logging
import time
from typing import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from processors.kafka import faults
from processors.kafka.errors import KafkaFailure
from projections.store import NO_OFFSET, Store

log = logging.getLogger("settle.restore")

BATCH_RECORDS = 10_000
RESTORE_TIMEOUT_S = 600.0
WATERMARK_TIMEOUT_S = 10.0


def restore(stores: dict[int, Store], client_config: dict, topic: str, group_id: str,
            progress: Callable[[int, int], None] = lambda partition, records: None) -> dict[int, int]:
    """Bring every store up to the end of its changelog partition; return records applied per partition."""
    consumer = Consumer({**client_config, "group.id": f"{group_id}-restore", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True,
                         "auto.offset.reset": "earliest"})
    applied = {p: 0 for p in stores}
    started = time.monotonic()
    try:
        todo = {}
        for partition, store in stores.items():
            stored = store.changelog_offset()
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=WATERMARK_TIMEOUT_S)
            if stored + 1 < high:  # else nothing was written after what the projection holds
                todo[partition] = OFFSET_BEGINNING if stored == NO_OFFSET else stored + 1
        if todo:
            consumer.assign([TopicPartition(topic, p, offset) for p, offset in todo.items()])
            _consume(consumer, topic, stores, set(todo), applied, started, progress)
    finally:
        consumer.close()
    for partition, count in applied.items():
        log.info("partition %d restored: %d changelog records applied, projection at changelog offset %d",
                 partition, count, stores[partition].changelog_offset())
    return applied


def _consume(consumer: Consumer, topic: str, stores: dict[int, Store], pending: set[int], applied: dict[int, int],
             started: float, progress) -> None:
    batches: dict[int, list] = {p: [] for p in pending}
    last: dict[int, int] = {}

    def flush(partition: int) -> None:
        if batches[partition]:
            stores[partition].write(batches[partition], last[partition])
            applied[partition] += len(batches[partition])
            batches[partition] = []
            progress(partition, applied[partition])

    while pending:
        if time.monotonic() - started > RESTORE_TIMEOUT_S:
            raise KafkaFailure(f"restore of {topic} partitions {sorted(pending)} did not reach the end in "
                               f"{RESTORE_TIMEOUT_S:.0f} s")
        for message in consumer.consume(num_messages=1_000, timeout=1.0):
            partition = message.partition()
            err = message.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    if partition in pending:
                        flush(partition)
                        pending.discard(partition)
                    continue
                raise KafkaFailure(f"restore of {topic}[{partition}]: {err.str()} ({err.name()})",
                                   code=err.name(), retriable=err.retriable(), fatal=err.fatal())
            batches[partition].append((message.key(), message.value()))
            last[partition] = message.offset()
            if len(batches[partition]) >= BATCH_RECORDS:
                flush(partition)
                faults.crash_point("mid_restore")
