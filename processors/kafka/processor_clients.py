"""The processor's own Kafka clients and their settings: the transactional producer every checkpoint commits
with, the group consumer of the input topic, and the timeout of each transactional call.
"""

from __future__ import annotations

import logging
import time

from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.errors import KafkaFailure, TransactionCallStuck
from branch_settlement.processors.kafka.txn_guard import bounded, check_stuck_budget

log = logging.getLogger("settle.processor")

TXN_CALL_TIMEOUT_MAX_S = 10.0

# The transactional producer's tuning, which a user's librdkafka settings (--kafka-config, SETTLE_KAFKA_*, the
# [kafka] table) may override. retry.backoff.ms: the coordinator answers CONCURRENT_TRANSACTIONS to the next
# transaction's AddOffsetsToTxn while it still writes the previous one's commit markers (a few ms; more on a busy
# broker), and librdkafka retries it after retry.backoff.ms: at the default 100 ms one such answer made a
# checkpoint 115 ms longer. 10 ms, doubling on each further retry up to retry.backoff.max.ms (1 s), as for
# every other request (docs/decisions.md, decision 31). The pass-through ceiling (bench/suite/passthrough.py)
# uses the same settings.
PRODUCER_TUNING = {"linger.ms": 5, "compression.type": "lz4", "retry.backoff.ms": 10}
# What exactly-once needs, never overridden.
PRODUCER_GUARANTEES = {"enable.idempotence": True, "acks": "all"}
INIT_ATTEMPTS = 5
INIT_BACKOFF_S = 2.0


def new_producer(config: ProcessorConfig, extra: Mapping = {}) -> Producer:
    """A transactional producer whose init_transactions fenced every earlier producer with this
    transactional.id and aborted (or completed) its open transaction. Retried while the coordinator is
    unavailable or the call blocks (after a broker restart), up to INIT_ATTEMPTS times. `extra`: settings of
    this client alone (its statistics, reporting.client_statistics)."""
    timeout_s = config.transaction_timeout_ms / 1000
    for attempt in range(1, INIT_ATTEMPTS + 1):
        check_stuck_budget()
        producer = Producer(producer_settings(config, extra))
        try:
            bounded("init_transactions", producer.init_transactions, timeout_s, timeout_s=timeout_s)
        except TransactionCallStuck as exc:
            failure: Exception = exc
        except KafkaException as exc:
            if not _init_retriable(exc):
                raise
            failure = exc
        else:
            log.info("transactional producer ready: transactional.id=%s", config.transactional_id)
            return producer
        if attempt == INIT_ATTEMPTS:
            raise KafkaFailure(f"init_transactions failed {attempt} times, last: {failure}", retriable=True)
        log.warning("init_transactions attempt %d of %d failed (%s); retrying in %.1f s", attempt,
                    INIT_ATTEMPTS, failure, INIT_BACKOFF_S)
        time.sleep(INIT_BACKOFF_S)
    raise AssertionError("unreachable")


def producer_settings(config: ProcessorConfig, extra: Mapping = {}) -> dict:
    """The transactional producer's librdkafka settings: PRODUCER_TUNING, then the user's (which may change
    it), then what exactly-once needs (which nothing changes)."""
    return {**PRODUCER_TUNING, **config.client_config(), **PRODUCER_GUARANTEES,
            "transactional.id": config.transactional_id, "transaction.timeout.ms": config.transaction_timeout_ms,
            **extra}


def _init_retriable(exc: KafkaException) -> bool:
    """Whether a failed init_transactions may pass by itself: a retriable or timed-out error, never a fatal one."""
    err = exc.args[0] if exc.args else None
    return isinstance(err, KafkaError) and not err.fatal() and (
        err.retriable() or err.code() == KafkaError._TIMED_OUT)


def new_consumer(config: ProcessorConfig, extra: Mapping = {}) -> Consumer:
    """A group member that reads committed input only and commits its offsets only inside a checkpoint's
    transaction (never by itself). `extra`: settings of this client alone (its statistics)."""
    return Consumer({**config.client_config(), "group.id": config.group_id, "isolation.level": "read_committed",
                     "enable.auto.commit": False, "enable.auto.offset.store": False,
                     "auto.offset.reset": "earliest", "session.timeout.ms": config.session_timeout_ms,
                     "max.poll.interval.ms": config.max_poll_interval_ms,
                     "heartbeat.interval.ms": max(config.session_timeout_ms // 5, 100), **extra})


def call_timeout_s(config: ProcessorConfig) -> float:
    """Per transactional call: short enough that a stuck coordinator is noticed well within the poll
    interval, long enough for a commit on a busy broker."""
    return min(config.transaction_timeout_ms / 1000 / 3, TXN_CALL_TIMEOUT_MAX_S)
