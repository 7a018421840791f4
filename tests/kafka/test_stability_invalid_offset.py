"""The stability watch (processors/kafka/stability.py) on the replicated cluster's answers: after a broker that
led some of the processor's partitions was killed (faults `coordinator_kill`, seed 7001 of the full run), the
admin client's read_committed ListOffsets answered offset -1001 (librdkafka's RD_KAFKA_OFFSET_INVALID), without
an error, for partitions whose leader had moved; the watch took it for a last stable offset, found every
committed record past it and logged `IS NOT READABLE past offset -1001` (CRITICAL, gauge 1) for partitions
that read_committed consumers were reading (the verifier's I5 and R2 held). A negative offset is never a last
stable offset: it proves nothing, like a broker that does not answer."""

from __future__ import annotations

import logging

from tests.kafka.test_stability_watch import TP, step, value, watch_with

OFFSET_INVALID = -1001


def test_an_invalid_offset_after_a_leader_failover_proves_nothing(caplog) -> None:
    watch, admin, clock, gauge = watch_with(threshold_s=20.0)
    watch.committed({TP: 41})
    admin.stable[TP] = OFFSET_INVALID
    for _ in range(4):  # 44 s of invalid answers, past the threshold
        step(watch, clock, 11)
    assert watch.unreadable() == [] and value(gauge) == 0
    assert not [r for r in caplog.records if r.levelno == logging.CRITICAL]
    admin.stable[TP] = 42  # a real answer: readable, forgotten
    step(watch, clock, 11)
    assert watch.unreadable() == []
