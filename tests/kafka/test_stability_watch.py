"""The stability watch's bookkeeping (processors/kafka/stability.py), with the admin client's ListOffsets
answered by hand and a hand-moved clock. tests/kafka/test_stability.py holds a partition open for real."""

from __future__ import annotations

import logging
from concurrent.futures import Future

from confluent_kafka import KafkaError, KafkaException
from prometheus_client import CollectorRegistry, Gauge

from branch_settlement.processors.kafka.stability import StabilityWatch, stall_threshold_s

TP = ("p.settlement-results", 0)


class Offset:
    def __init__(self, offset: int) -> None:
        self.offset = offset


class FakeAdmin:
    """Answers list_offsets from `stable` (topic, partition) -> last stable offset, or an error."""

    def __init__(self) -> None:
        self.stable: dict[tuple[str, int], int | KafkaError] = {}
        self.requests = 0

    def list_offsets(self, request, isolation_level, request_timeout):
        self.requests += 1
        answers = {}
        for tp in request:
            future: Future = Future()
            value = self.stable[(tp.topic, tp.partition)]
            if isinstance(value, KafkaError):
                future.set_exception(KafkaException(value))
            else:
                future.set_result(Offset(value))
            answers[tp] = future
        return answers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch_with(threshold_s: float = 20.0):
    admin, clock = FakeAdmin(), Clock()
    gauge = Gauge("unreadable", "test", ["topic", "partition"], registry=CollectorRegistry())
    return StabilityWatch(lambda: admin, threshold_s, gauge, clock=clock), admin, clock, gauge


def value(gauge, tp=TP) -> float:
    return gauge.labels(tp[0], str(tp[1]))._value.get()


def step(watch, clock, seconds: float) -> None:
    """Time passes; the loop polls twice (one to send a due query, one to read its answer)."""
    clock.now += seconds
    watch.poll()
    watch.poll()


def test_the_threshold_is_twice_the_transaction_timeout_and_at_least_ten_seconds() -> None:
    assert stall_threshold_s(30_000) == 60.0
    assert stall_threshold_s(2_000) == 10.0


def test_a_commit_that_becomes_readable_is_forgotten(caplog) -> None:
    watch, admin, clock, gauge = watch_with()
    watch.committed({TP: 41})
    admin.stable[TP] = 42  # readable past offset 41
    step(watch, clock, 11)
    assert admin.requests == 1 and watch.unreadable() == []
    step(watch, clock, 11)
    assert admin.requests == 1  # nothing left to ask about
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_partition_held_past_the_threshold_is_reported_once_and_its_recovery_too(caplog) -> None:
    watch, admin, clock, gauge = watch_with(threshold_s=20.0)
    watch.committed({TP: 41})
    admin.stable[TP] = 30  # something at offset 30 is still open
    step(watch, clock, 10)
    assert watch.unreadable() == [] and value(gauge) == 0  # not yet past the threshold
    step(watch, clock, 11)
    assert watch.unreadable() == [TP] and value(gauge) == 1
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1
    message = critical[0].getMessage()
    assert "p.settlement-results[0] IS NOT READABLE past offset 30" in message
    assert "committed at offset 41" in message and "kafka-transactions.sh" in message
    watch.committed({TP: 57})  # the processor goes on committing there
    step(watch, clock, 11)
    assert len([r for r in caplog.records if r.levelno == logging.CRITICAL]) == 1  # said once
    admin.stable[TP] = 58  # the open transaction ended
    step(watch, clock, 11)
    assert watch.unreadable() == [] and value(gauge) == 0
    assert any("p.settlement-results[0] is readable again" in r.getMessage() for r in caplog.records)


def test_the_clock_restarts_from_the_newest_commit_once_the_oldest_is_readable() -> None:
    watch, admin, clock, gauge = watch_with(threshold_s=20.0)
    watch.committed({TP: 10})
    clock.now += 15
    watch.committed({TP: 20})  # committed 15 s after the first
    admin.stable[TP] = 11  # the first is readable, the second not (yet)
    step(watch, clock, 10)
    step(watch, clock, 10)  # 20 s after the first commit, but only 15 after the second
    assert watch.unreadable() == []
    step(watch, clock, 10)
    assert watch.unreadable() == [TP]


def test_a_broker_that_does_not_answer_is_asked_again_and_proves_nothing() -> None:
    watch, admin, clock, gauge = watch_with(threshold_s=20.0)
    watch.committed({TP: 41})
    admin.stable[TP] = KafkaError(KafkaError._TRANSPORT, "down")
    for _ in range(5):
        step(watch, clock, 11)
    assert admin.requests == 5 and watch.unreadable() == []
    admin.stable[TP] = 42
    step(watch, clock, 11)
    assert watch.unreadable() == [] and admin.requests == 6


def test_partitions_given_away_are_no_longer_watched() -> None:
    watch, admin, clock, gauge = watch_with(threshold_s=20.0)
    watch.committed({TP: 41})
    admin.stable[TP] = 30
    step(watch, clock, 21)
    assert value(gauge) == 1
    watch.forget([TP, ("p.settlement-results", 5)])
    assert watch.unreadable() == [] and value(gauge) == 0
    step(watch, clock, 11)
    assert admin.requests == 1
