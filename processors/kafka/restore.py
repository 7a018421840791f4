"""Restore projections from the ledger changelog (read_committed), each from the changelog offset stored
with it; a missing projection (offset -1) is rebuilt from the beginning.

A restore is complete only when the projection covers the committed input offset: every checkpoint writes
the partition's next input offset into the changelog, in the same transaction as the offsets it commits.
Reaching the end of the changelog is not enough: under read_committed the end is the last stable offset,
and a predecessor's commit markers may land on the changelog a moment after its offsets became stable.
So the restore goes on reading until the position is reached (or a deadline passes)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from branch_settlement.processors.kafka import faults
from branch_settlement.processors.kafka.clients import high_watermark
from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.processors.kafka.partition import INPUT_POSITION_KEY, input_position
from branch_settlement.projections.store import NO_OFFSET, Store
from branch_settlement.processors.kafka.errors import RestoreIncomplete

log = logging.getLogger("settle.restore")

BATCH_RECORDS = 10_000
# consume(n, timeout) waits out its timeout whenever fewer than n records are fetched: at the end of each
# changelog partition, which every restore (every assignment) reaches. Short, as the topic replay's.
IDLE_WAIT_S = 0.05
# The broker holds a fetch up to fetch.wait.max.ms when a partition has nothing new, i.e. at every changelog
# partition's end: short, not librdkafka's 500 ms. The fetch sizes keep librdkafka's defaults: larger fetches
# restore faster, but librdkafka holds what it fetched ahead outside the process's memory budget, and the
# faster sizes measured came too close to, or past, the memory the processor keeps to (docs/decisions.md, 13).
RESTORE_FETCH_WAIT_MS = 10
RESTORE_TIMEOUT_S = 600.0
WATERMARK_TIMEOUT_S = 10.0


def restore(stores: dict[int, Store], client_config: dict, topic: str, group_id: str,
            targets: dict[int, int] | None = None,
            progress: Callable[[int, int], None] = lambda partition, records: None) -> dict[int, int]:
    """Bring every store up to its target input position (the committed offset; < 0: none) and at least to
    the end of its changelog partition; return the records applied per partition."""
    targets = targets or {}
    consumer = Consumer({**client_config, "group.id": f"{group_id}-restore", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True,
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": RESTORE_FETCH_WAIT_MS})
    applied = {p: 0 for p in stores}
    started = time.monotonic()
    try:
        todo = {}
        for partition, store in stores.items():
            stored = store.changelog_offset()
            position = input_position(store)
            target = targets.get(partition, -1)
            if position is not None and target >= 0 and position > target:
                raise KafkaFailure(f"partition {partition}: the projection covers input offset {position}, beyond "
                                   f"the committed {target}: delete {store.path if hasattr(store, 'path') else 'it'} "
                                   "to rebuild it")
            # asked again while the broker is not ready (no leader yet, a leader moving): not a reason to stop
            high = high_watermark(consumer, TopicPartition(topic, partition), timeout_s=WATERMARK_TIMEOUT_S)
            if stored + 1 < high or (target >= 0 and (position or 0) < target):
                todo[partition] = OFFSET_BEGINNING if stored == NO_OFFSET else stored + 1
        if todo:
            consumer.assign([TopicPartition(topic, p, offset) for p, offset in todo.items()])
            _consume(consumer, topic, stores, targets, set(todo), applied, started, progress)
    finally:
        consumer.close()
    for partition, store in stores.items():
        position, target = input_position(store), targets.get(partition, -1)
        if position is not None and target >= 0 and position > target:
            raise KafkaFailure(f"partition {partition}: the changelog covers input offset {position}, beyond the "
                               f"committed offset {target}. Were the group's offsets reset by hand? Reset the "
                               "changelog and the projections with them, or set the offsets back")
    for partition, count in applied.items():
        log.info("partition %d restored: %d changelog records applied; projection at changelog offset %d, "
                 "input offset %s", partition, count, stores[partition].changelog_offset(),
                 input_position(stores[partition]))
    return applied


def _consume(consumer: Consumer, topic: str, stores: dict[int, Store], targets: dict[int, int], pending: set[int],
             applied: dict[int, int], started: float, progress) -> None:
    batches: dict[int, list] = {p: [] for p in pending}  # the consumed messages, written BATCH_RECORDS at a time
    position = {p: input_position(stores[p]) or 0 for p in pending}

    def flush(partition: int) -> None:
        batch = batches[partition]
        if batch:
            changes = [(message.key(), message.value()) for message in batch]
            for key, value in reversed(changes):  # each checkpoint's records end with its input position
                if key == INPUT_POSITION_KEY:
                    position[partition] = int(value)
                    break
            stores[partition].write(changes, batch[-1].offset())
            applied[partition] += len(batch)
            batches[partition] = []
            progress(partition, applied[partition])
            faults.crash_point("mid_restore")

    while pending:
        if time.monotonic() - started > RESTORE_TIMEOUT_S:
            raise RestoreIncomplete(
                f"restore of {topic} partitions {sorted(pending)} did not reach the committed input offsets "
                f"{ {p: targets.get(p) for p in pending} } in {RESTORE_TIMEOUT_S:.0f} s (at {position})")
        for message in consumer.consume(num_messages=BATCH_RECORDS, timeout=IDLE_WAIT_S):
            if message.error() is None:  # the hot path: two calls per record, the rest once per batch
                batch = batches[message.partition()]
                batch.append(message)
                if len(batch) >= BATCH_RECORDS:
                    flush(message.partition())
                continue
            partition = message.partition()
            err = message.error()
            if err.code() == KafkaError._PARTITION_EOF:
                if partition in pending:
                    flush(partition)
                    if position[partition] >= targets.get(partition, -1):
                        pending.discard(partition)
                continue
            raise KafkaFailure(f"restore of {topic}[{partition}]: {err.str()} ({err.name()})",
                               code=err.name(), retriable=err.retriable(), fatal=err.fatal())
