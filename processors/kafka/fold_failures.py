"""What becomes of an input the fold cannot take. Bad input (a record that does not decode) is the
producer's mistake: it goes to the dead-letter topic and the partition goes on. A fold that raises is a bug
of ours: its partition stops, and the others go on.
"""

from __future__ import annotations

import logging

from confluent_kafka import Consumer, TopicPartition

from branch_settlement.processors.kafka.errors import RecordTooLarge
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.processors.ledger.errors import InvariantViolation
from branch_settlement.schemas.codec import CodecError

log = logging.getLogger("settle.processor")


def dead_letter(task: PartitionTask, message, offset: int, exc: CodecError, metrics: Metrics) -> None:
    """Buffer a DeadLetter with the original bytes, where they came from and why they did not decode."""
    task.dead_letter(message.key(), {
        "source_topic": message.topic(), "partition": message.partition(), "offset": offset,
        "original": message.value() or b"", "reason": str(exc), "line": None, "event_id": None})
    metrics.dead_letters.inc()


def stop_partition(task: PartitionTask, violation: Exception, consumer: Consumer, input_topic: str,
                   metrics: Metrics, remedy: str = "Do not repair with a release: fix the fold and restart.") -> None:
    """A bug (or a setting below what the fold writes), not bad input: stop this partition (the others go
    on), keep its committed state, say so. Its uncommitted work is discarded, so a half-applied event is
    never committed."""
    task.discard()
    task.stopped = str(violation)
    consumer.pause([TopicPartition(input_topic, task.partition)])
    metrics.stopped.labels(str(task.partition)).set(1)
    log.critical("PARTITION %d STOPPED: %s. Its committed offset and ledger are untouched; the input is "
                 "kept. %s", task.partition, violation, remedy,
                 exc_info=not isinstance(violation, (InvariantViolation, RecordTooLarge)))
