"""What the processor does when a checkpoint failed, per kind of failure. None of them committed the work
since the last commit; each brings the processor back to a state it can go on from: the consumer moved back
to the committed offsets (a rewind), or every partition loaded again from the committed offsets and the
changelog (a reload) when even the in-memory projections cannot be trusted.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from confluent_kafka import TopicPartition

from branch_settlement.processors.kafka.checkpoint import rewind
from branch_settlement.processors.kafka.errors import (CommitOutcomeUnknown, FatalProducerError, KafkaFailure,
                                                       ProducerFenced)
from branch_settlement.processors.kafka.partition import PartitionTask

if TYPE_CHECKING:
    from branch_settlement.processors.kafka.processor import Processor

log = logging.getLogger("settle.processor")

FENCE_RETRIES = 4
FENCE_BACKOFF_S = 0.5


def recover(processor: Processor, failure: KafkaFailure, tasks: list[PartitionTask]) -> None:
    """After the checkpoint of `tasks` failed with `failure`. Raises when it cannot recover (a fence that
    persists)."""
    if isinstance(failure, ProducerFenced):
        recover_from_fence(processor, failure)
        rewind_or_reload(processor, tasks)
    elif isinstance(failure, FatalProducerError):
        log.error("%s: recreating the producer and replaying from the last commit", failure)
        replace_producer(processor)
        rewind_or_reload(processor, tasks)
    elif isinstance(failure, CommitOutcomeUnknown):
        log.error("%s: reloading every partition from the committed offsets and the changelog", failure)
        replace_producer(processor)  # the new one settles the pending transaction, whichever way it went
        reload(processor)
    else:  # a rewind that failed after a clean abort
        log.error("%s: reloading every partition from the committed offsets and the changelog", failure)
        reload(processor)


def recover_from_fence(processor: Processor, exc: ProducerFenced) -> None:
    """Fenced: either another process runs with this worker slot (a misconfiguration: it owns the slot
    now), or the broker fenced a fresh producer spuriously while aborting its crashed predecessor's open
    transaction (seen with librdkafka 2.x on Kafka 4.x right after a restart). Recreating the producer,
    after a pause, resolves the second; if the fence persists, the first is the case: stop. The count of
    fences starts over at every commit."""
    processor.fence_retries += 1
    if processor.fence_retries > FENCE_RETRIES:
        raise exc
    pause_s = FENCE_BACKOFF_S * 2 ** (processor.fence_retries - 1)
    log.warning("%s; recreating the producer in %.1f s (attempt %d of %d). If this repeats, another worker "
                "runs with worker slot %r.", exc, pause_s, processor.fence_retries, FENCE_RETRIES,
                processor.config.worker_slot)
    time.sleep(pause_s)
    replace_producer(processor)


def replace_producer(processor: Processor) -> None:
    """The processor's producer given up for a new one, whose `init_transactions` fences it. The given-up one may
    still be alive (a thread stuck in one of its calls holds it) and would go on sending what it has queued once
    the broker answers again: registering partitions in its transaction and appending records that only the fence
    then aborts. What it holds is dropped first (not waited for: it may be stuck), so that nothing but the fence
    is left between it and the log. Best effort: it is given up either way."""
    try:
        processor.producer.purge(in_queue=True, in_flight=True, blocking=False)
    except Exception as exc:  # noqa: BLE001 - nothing more to do with this producer
        log.warning("purging the given-up producer's queue: %s", exc)
    processor.producer = processor._new_producer()


def rewind_or_reload(processor: Processor, tasks: list[PartitionTask]) -> None:
    try:
        rewind(processor.consumer, tasks, processor.topics)
    except KafkaFailure as exc:
        log.error("%s: reloading every partition", exc)
        reload(processor)


def reload(processor: Processor) -> None:
    """Forget all in-memory state and load the owned partitions again, as on assignment: committed
    offsets, projections restored from the changelog, the consumer moved back to the offsets."""
    consumer = processor.consumer
    # What the group assigns now, not what we held: partitions may have been lost meanwhile.
    partitions = [TopicPartition(tp.topic, tp.partition) for tp in consumer.assignment()]
    for task in processor.tasks.values():
        task.discard()
        task.close()
    processor.tasks.clear()
    processor._load_partitions(consumer, partitions)
    for task in processor.tasks.values():
        consumer.seek(TopicPartition(processor.topics["branch-events"], task.partition, task.committed_position))
