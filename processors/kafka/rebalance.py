"""The consumer group's rebalance callbacks (partitions assigned, revoked, lost), and the watchdog that replaces
a consumer which does not rejoin the group after losing its partitions.

Each callback ignores a consumer that is no longer the processor's: a given-up consumer's callbacks run while
it closes, on a thread of its own, and nothing they report is ours any more.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from branch_settlement.processors.kafka.errors import TransactionCallStuck
from branch_settlement.processors.kafka.txn_guard import bounded

if TYPE_CHECKING:
    from branch_settlement.processors.kafka.processor import Processor

log = logging.getLogger("settle.processor")

REJOIN_MIN_S = 15.0


def on_assign(processor: Processor, consumer: Consumer, partitions: list[TopicPartition]) -> None:
    if consumer is not processor.consumer:
        return
    processor.lost_at = None
    processor._load_partitions(consumer, partitions)
    log.info("assigned partitions %s", sorted(tp.partition for tp in partitions))


def on_revoke(processor: Processor, consumer: Consumer, partitions: list[TopicPartition]) -> None:
    if consumer is not processor.consumer:
        return
    revoked = sorted(tp.partition for tp in partitions)
    if not processor.failed and processor._has_work():
        processor.checkpoint()  # commit what was folded before giving the partitions away
    _drop(processor, revoked, revoked)
    log.info("revoked partitions %s", revoked)


def on_lost(processor: Processor, consumer: Consumer, partitions: list[TopicPartition]) -> None:
    """Another member owns them already: nothing may be committed for them."""
    if consumer is not processor.consumer:
        return
    processor.lost_at = time.monotonic()
    lost = {tp.partition for tp in partitions}
    _drop(processor, [tp.partition for tp in partitions], lost)
    processor.spoil_transaction(lost, "lost")
    log.warning("lost partitions %s (session expired): uncommitted work discarded",
                sorted(tp.partition for tp in partitions))


def _drop(processor: Processor, partitions: list[int], given_away: Iterable[int]) -> None:
    """Forget the partitions given away: their tasks with their uncommitted work (ticks included), and what the
    stability watch was watching there (a partition's new owner watches what it writes now)."""
    for p in partitions:
        task = processor.tasks.pop(p, None)
        if task is not None:
            task.discard()
            task.close()
    processor.stability.forget([(topic, p) for topic in processor.topics.values() for p in given_away])


def rejoin_deadline_s(session_timeout_ms: int) -> float:
    return max(REJOIN_MIN_S, 3 * session_timeout_ms / 1000)


def replace_consumer_if_not_rejoined(processor: Processor) -> None:
    """After its session expired (a broker restart, a network partition) the consumer rejoins the group by
    itself; librdkafka sometimes never does (a stale cached group coordinator: docs/faults.md, finding 1).
    Nothing is owned meanwhile, so nothing is lost by starting over with a new consumer."""
    lost_at = processor.lost_at
    if lost_at is None or time.monotonic() - lost_at < rejoin_deadline_s(processor.config.session_timeout_ms):
        return
    log.error("no partitions assigned %.0f s after losing them: replacing the consumer", time.monotonic() - lost_at)
    old = processor.consumer
    processor.metrics.consumer_replacements.inc()
    processor._subscribe()
    processor.lost_at = time.monotonic()  # the new consumer gets the same time to join
    try:  # leaves the group if it can; its callbacks are ignored (it is no longer processor.consumer)
        bounded("consumer.close", old.close, timeout_s=processor.config.session_timeout_ms / 1000)
    except TransactionCallStuck:
        log.warning("the replaced consumer did not close; left behind")
    except KafkaException as exc:
        log.warning("closing the replaced consumer: %s", exc)
