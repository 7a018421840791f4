"""The clients of both sides against a real processor on the real broker: events published with the producer
API; the consumer API (processors/kafka/consumers.py) hands over typed releases of both kinds and the
results, commits only past what the handler applied (a failing handler's record comes again after a restart,
and with a SeenKeys store it is applied once), stops cleanly on SIGTERM; wait-for-result returns the event's
own result and times out cleanly; the faust example (examples/faust_releases.py) applies every release once,
reading read_committed. One processor for the module; each test reads in a consumer group of its own."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import NewTopic

from branch_settlement.errors import ConfigError, SettlementError
from branch_settlement.processors.kafka import topics
from branch_settlement.processors.kafka.clients import BranchEventProducer, ResultWaiter, read_outputs
from branch_settlement.processors.kafka.consumers import (Balance, BoundedSeenKeys, CapacityReleased,
                                                          ParentSettled, SettlementConsumer, SettlementResult, Source,
                                                          SqliteSeenKeys, decode_output, encode_output,
                                                          from_record)
from branch_settlement.processors.kafka.errors import HandlerFailed, ResultTimeout, UndecodableOutput
from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.partitioning import partition_of
from tests.kafka.conftest import ADMIN_TIMEOUT_S, KafkaTopics
from tests.kafka.pipeline import REPO, ProcessorProcess, read_partitions, wait_for_results

POLICY = {"max_live_children": 8, "reconciliation_timeout_ms": 600_000, "lending_limit": {}}
PARENTS = 6
EVENTS_PER_PARENT = 10
ABORTED_KEY = "aborted/never/applied/tokens/parent"


def now_ms() -> int:
    return int(time.time() * 1000)


def publish_scenario(producer: BranchEventProducer, parent: str) -> None:
    """Per parent: 100 tokens; A (20) completes with 12, B (30) completes with 30, C (10) is skipped, then the
    parent closes: releases A 8 and C 10 to the parent, 58 to the global pool, and one ParentSettled."""
    t = now_ms()
    producer.parent_reserved(parent, capacity={"tokens": {"quantity": 100, "kind": "logical"}},
                             lease_ttl_ms=3_600_000, policy=POLICY, idempotency_key=f"{parent}/ParentReserved/1",
                             occurred_at_ms=t)
    for child, quantity in (("A", 20), ("B", 30), ("C", 10)):
        producer.child_reserved(parent, child_id=child, branch_id=child, attempt_id=f"{child}1",
                                quantities={"tokens": quantity}, idempotency_key=f"{parent}/{child}/{child}1/reserve",
                                occurred_at_ms=t)
    for child in ("A", "B"):
        producer.child_activated(parent, child_id=child, attempt_id=f"{child}1", lease_generation=1,
                                 lease_ttl_ms=600_000, idempotency_key=f"{parent}/{child}/{child}1/activate",
                                 occurred_at_ms=t)
    producer.child_completed(parent, child_id="A", attempt_id="A1", lease_generation=1, usage={"tokens": 12},
                             idempotency_key=f"{parent}/A/A1/1", occurred_at_ms=t)
    producer.child_skipped(parent, child_id="C", attempt_id="C1", reason="pruned",
                           idempotency_key=f"{parent}/C/C1/1", occurred_at_ms=t)
    producer.child_completed(parent, child_id="B", attempt_id="B1", lease_generation=1, usage={"tokens": 30},
                             idempotency_key=f"{parent}/B/B1/1", occurred_at_ms=t)
    producer.parent_closed(parent, outcome="succeeded", idempotency_key=f"{parent}/ParentClosed/1",
                           occurred_at_ms=t)


def write_aborted_release(bootstrap: str, topic: str) -> None:
    """A CapacityReleased in a transaction that is aborted: a read_committed reader never sees it."""
    balance = {"kind": "logical", "capacity": 1, "available": 0, "outstanding": 0, "pending": 0,
               "awaiting_confirmation": 0, "lent": 0, "returned_to_pool": 0, "committed": 0, "overdrawn": 0}
    record = {"release_key": ABORTED_KEY, "parent_id": "aborted", "child_id": "never", "attempt_id": "x",
              "dimension": "tokens", "quantity": 1_000_000, "destination": "parent", "reason": "completed",
              "idempotency_key": "never", "triggering_event_id": "never", "balance": balance,
              "input_partition": 0, "input_offset": 0, "ledger_time_ms": 0}
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"aborter-{uuid.uuid4()}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for partition in range(8):
        producer.produce(topic, value=default_codec().encode("CapacityReleased", record), key=b"aborted",
                         partition=partition)
    producer.flush(30)
    producer.abort_transaction(30)


@dataclass
class Pipeline:
    topics: KafkaTopics
    config: dict
    parents: list[str]
    releases: list[CapacityReleased]   # what the processor committed, read with read_outputs
    settled: list[ParentSettled]
    results: list[SettlementResult]    # of the input events

    @property
    def releases_topic(self) -> str:
        return self.topics.name("capacity-releases")

    @property
    def results_topic(self) -> str:
        return self.topics.name("settlement-results")

    def release_records(self) -> list:
        return [*self.releases, *self.settled]


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap, kafka_admin, tmp_path_factory):
    prefix = f"t.consumer-api.{uuid.uuid4().hex[:8]}."
    spec = topics.load_spec(topics.DEFAULT_SPEC_PATH, prefix=prefix)
    assert not topics.has_drift(topics.apply(kafka_admin, spec, timeout_s=ADMIN_TIMEOUT_S))
    kt = KafkaTopics(bootstrap_servers=kafka_bootstrap, prefix=prefix, spec=spec)
    config = {"bootstrap.servers": kafka_bootstrap}
    tmp = tmp_path_factory.mktemp("consumer-api")
    write_aborted_release(kafka_bootstrap, kt.name("capacity-releases"))
    run = uuid.uuid4().hex[:6]
    proc = ProcessorProcess(kt, tmp / "state", tmp / "processor.log", slot=f"consumer-api-{run}",
                            group=f"consumer-api-{uuid.uuid4()}")
    try:
        producer = BranchEventProducer(config, kt.name("branch-events"))
        parents = [f"quota-{run}-{n}" for n in range(PARENTS)]
        for parent in parents:
            publish_scenario(producer, parent)
        producer.close()
        wait_for_results(kafka_bootstrap, kt, PARENTS * EVENTS_PER_PARENT, timeout_s=90, procs=[proc])
        outputs = [from_record(o.kind, o.record, Source(o.topic, o.partition, o.offset)) for o in read_outputs(
            config, [kt.name("capacity-releases"), kt.name("settlement-results")], idle_timeout_s=1)]
        yield Pipeline(
            kt, config, parents,
            releases=[o for o in outputs if isinstance(o, CapacityReleased)],
            settled=[o for o in outputs if isinstance(o, ParentSettled)],
            results=[o for o in outputs if isinstance(o, SettlementResult) and not o.is_processor_tick])
    finally:
        code = proc.stop()
        leftovers = [name for name in kafka_admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics if name.startswith(prefix)]
        topics.delete_topics(kafka_admin, leftovers, timeout_s=ADMIN_TIMEOUT_S)
    assert code == 0, proc.output()[-3000:]


def drain(consumer: SettlementConsumer, handler, until, timeout_s: float = 60, batches: bool = False) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"timed out; stats {consumer.stats}"
        (consumer.poll_batch if batches else consumer.poll)(handler, 0.5)


def group() -> str:
    return f"consumer-api-{uuid.uuid4()}"


# -- what the processor committed, in the consumer's types --------------------------------------------------

@pytest.mark.kafka
def test_the_processor_committed_the_scenario(pipeline) -> None:
    """The reference every consumer test compares with: 3 releases and 1 summary per parent, no aborted one."""
    by_parent = defaultdict(list)
    for release in pipeline.releases:
        by_parent[release.parent_id].append((release.child_id, release.quantity, release.destination, release.reason))
    assert {p: sorted(v) for p, v in by_parent.items()} == {p: [("", 58, "global_pool", "parent_closed"),
                                                                ("A", 8, "parent", "completed"),
                                                                ("C", 10, "parent", "skipped")]
                                                            for p in pipeline.parents}
    assert sorted(s.parent_id for s in pipeline.settled) == sorted(pipeline.parents)
    for settled in pipeline.settled:  # a parent's summary comes after every release of it, in its partition
        assert all(r.source.offset < settled.source.offset and r.source.partition == settled.source.partition
                   for r in pipeline.releases if r.parent_id == settled.parent_id)
    assert all(s.outcome == "succeeded" and s.dimensions["tokens"] == Balance(
        "logical", capacity=100, available=0, outstanding=0, pending=0, awaiting_confirmation=0, lent=0,
        returned_to_pool=58, committed=42, overdrawn=0) for s in pipeline.settled)
    assert len(pipeline.results) == PARENTS * EVENTS_PER_PARENT and all(r.result == "ok" for r in pipeline.results)


@pytest.mark.kafka
def test_consumer_hands_over_typed_records_of_both_kinds_and_the_results(pipeline) -> None:
    got = []
    expected = len(pipeline.release_records()) + len(pipeline.results)
    with SettlementConsumer(pipeline.config, group_id=group(),
                            topics=[pipeline.releases_topic, pipeline.results_topic]) as consumer:
        drain(consumer, got.append, lambda: len(got) >= expected)
        for _ in range(3):  # nothing more than that: no record twice, no aborted one
            consumer.poll(got.append, 0.5)
    releases = [r for r in got if isinstance(r, CapacityReleased)]
    settled = [r for r in got if isinstance(r, ParentSettled)]
    results = [r for r in got if isinstance(r, SettlementResult)]
    assert len(got) == expected == len(releases) + len(settled) + len(results)
    assert sorted(releases, key=lambda r: r.release_key) == sorted(pipeline.releases, key=lambda r: r.release_key)
    assert sorted(settled, key=lambda r: r.parent_id) == sorted(pipeline.settled, key=lambda r: r.parent_id)
    assert sorted(results, key=lambda r: r.event_id) == sorted(pipeline.results, key=lambda r: r.event_id)
    assert ABORTED_KEY not in {r.release_key for r in releases}
    assert not any(r.is_processor_tick for r in results)  # include_ticks=False
    assert consumer.stats.ticks_skipped > 0
    parent_level = [r for r in releases if r.parent_level]
    assert {(r.child_id, r.attempt_id, r.destination) for r in parent_level} == {("", "", "global_pool")}
    assert not hasattr(settled[0], "child_id") and not hasattr(settled[0], "release_key")
    for record in got:  # each kind in its own topic and in partition order
        assert record.source.topic == (pipeline.results_topic if record.kind == "SettlementResult"
                                       else pipeline.releases_topic)
        assert record.source.partition == partition_of(record.parent_id, 8)


# -- at-least-once, and dedupe ---------------------------------------------------------------------------

SCHEMA = "CREATE TABLE IF NOT EXISTS credited (release_key TEXT, parent_id TEXT, destination TEXT, quantity INTEGER)"


def credit(db: sqlite3.Connection, record) -> None:
    if isinstance(record, CapacityReleased):
        db.execute("INSERT INTO credited VALUES (?, ?, ?, ?)",
                   (record.release_key, record.parent_id, record.destination, record.quantity))


def credited(db: sqlite3.Connection) -> Counter:
    return Counter(key for (key,) in db.execute("SELECT release_key FROM credited"))


@pytest.mark.kafka
def test_a_failing_handler_commits_nothing_from_its_record_on_and_the_record_comes_again_once(
        pipeline, tmp_path: Path) -> None:
    failing = next(r for r in pipeline.releases if r.parent_id == pipeline.parents[0] and r.reason == "skipped")
    store = SqliteSeenKeys(str(tmp_path / "service.db"))
    store.connection.execute(SCHEMA)
    deliveries = Counter()
    handled = {"first": [], "second": []}
    phase = "first"

    def handler(record) -> None:
        deliveries[record.dedupe_key] += 1
        credit(store.connection, record)  # in the store's transaction: rolled back with the key on a failure
        if record.dedupe_key == failing.dedupe_key and deliveries[record.dedupe_key] == 1:
            raise RuntimeError("quota database unavailable")
        handled[phase].append(record)

    name = group()
    first = SettlementConsumer(pipeline.config, group_id=name, topics=[pipeline.releases_topic], dedupe=store)
    with pytest.raises(HandlerFailed) as failed:
        drain(first, handler, lambda: False)
    assert failed.value.records == [failing] and isinstance(failed.value.__cause__, RuntimeError)
    assert isinstance(failed.value, SettlementError)
    where = (failing.source.topic, failing.source.partition)
    # everything before it in its partition is committed, nothing from it on
    assert first.committed()[where] == failing.source.offset
    assert failing.dedupe_key not in store and credited(store.connection)[failing.release_key] == 0
    first.close()  # a restart

    phase = "second"
    second = SettlementConsumer(pipeline.config, group_id=name, topics=[pipeline.releases_topic], dedupe=store)
    with second:
        drain(second, handler, lambda: len(store) == len(pipeline.release_records()))
    in_partition = [r for r in handled["second"] if (r.source.topic, r.source.partition) == where]
    assert in_partition[0] == failing and in_partition[0].source.offset == failing.source.offset
    assert second.stats.duplicates == 0  # nothing handled before came again: it was committed
    assert not {r.dedupe_key for r in handled["first"]} & {r.dedupe_key for r in handled["second"]}
    assert len(handled["first"]) + len(handled["second"]) == len(pipeline.release_records())
    assert deliveries[failing.dedupe_key] == 2
    assert credited(store.connection) == Counter({r.release_key: 1 for r in pipeline.releases})


class Crash(BaseException):
    """The process dies between the handler's effect and the offset commit."""


@pytest.mark.kafka
@pytest.mark.parametrize("dedupe", ["sqlite", "memory", "none"])
def test_records_handled_but_not_committed_come_again_and_dedupe_applies_them_once(
        pipeline, tmp_path: Path, dedupe: str) -> None:
    db = sqlite3.connect(tmp_path / "service.db", isolation_level=None)
    store = {"sqlite": lambda: SqliteSeenKeys(db), "memory": BoundedSeenKeys, "none": lambda: None}[dedupe]()
    db.execute(SCHEMA)
    applied = Counter()

    def handler(record) -> None:
        applied[record.dedupe_key] += 1
        credit(db, record)

    name = group()
    first = SettlementConsumer(pipeline.config, group_id=name, topics=[pipeline.releases_topic], dedupe=store)

    def crash(messages) -> None:
        raise Crash()

    first._commit = crash
    with pytest.raises(Crash):
        drain(first, handler, lambda: False)
    first.close()
    handled_first = set(applied)
    assert handled_first and first.stats.commits == 0

    second = SettlementConsumer(pipeline.config, group_id=name, topics=[pipeline.releases_topic], dedupe=store)
    with second:
        drain(second, handler, lambda: second.stats.handled + second.stats.duplicates >= len(pipeline.release_records()))
    assert set(applied) == {r.dedupe_key for r in pipeline.release_records()}
    if dedupe == "none":  # the control: at-least-once alone applies them twice
        assert {key for key, n in applied.items() if n == 2} == handled_first
        assert second.stats.duplicates == 0
    else:
        assert set(applied.values()) == {1}
        assert second.stats.duplicates == len(handled_first)
        assert credited(db) == Counter({r.release_key: 1 for r in pipeline.releases})


@pytest.mark.kafka
def test_a_failing_batch_handler_gets_its_batch_again(pipeline) -> None:
    failed_batch = []

    def failing(batch) -> None:
        failed_batch.extend(r.dedupe_key for r in batch)
        raise RuntimeError("down")

    again = []
    with SettlementConsumer(pipeline.config, group_id=group(), topics=[pipeline.releases_topic],
                            dedupe=BoundedSeenKeys()) as consumer:
        with pytest.raises(HandlerFailed) as failed:
            drain(consumer, failing, lambda: False, batches=True)
        assert [r.dedupe_key for r in failed.value.records] == failed_batch
        assert consumer.committed() == {}
        # the same consumer, rewound: the failed batch comes again, then the rest, each record once
        drain(consumer, lambda batch: again.extend(r.dedupe_key for r in batch),
              lambda: len(set(again)) == len(pipeline.release_records()), batches=True)
        assert consumer.stats.duplicates == 0
    assert set(failed_batch) <= set(again) and len(again) == len(set(again)) == len(pipeline.release_records())


CONSUMER_SCRIPT = """
import json, sys
from branch_settlement.processors.kafka.consumers import SettlementConsumer
consumer = SettlementConsumer({"bootstrap.servers": sys.argv[1]}, group_id=sys.argv[2], topics=[sys.argv[3]])
stats = consumer.run(lambda record: print("handled", record.kind, record.dedupe_key, flush=True))
print("stopped", json.dumps(vars(stats)), flush=True)
"""


@pytest.mark.kafka
def test_sigterm_stops_the_consumer_cleanly_with_its_offsets_committed(pipeline, tmp_path: Path) -> None:
    name = group()
    log = tmp_path / "consumer.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", CONSUMER_SCRIPT, pipeline.config["bootstrap.servers"], name,
                                 pipeline.releases_topic], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count("handled ") < len(pipeline.release_records()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()
    stats = json.loads(next(line for line in lines if line.startswith("stopped "))[len("stopped "):])
    assert stats["handled"] == len(pipeline.release_records()) and stats["commits"] >= 1
    assert sum(line.startswith("handled ") for line in lines) == len(pipeline.release_records())
    with SettlementConsumer(pipeline.config, group_id=name, topics=[pipeline.releases_topic]) as again:
        for _ in range(6):  # the restart has nothing left: every handled record was committed
            assert again.poll(lambda r: pytest.fail(f"{r} came again"), 0.5) == 0


# -- the producer: wait for the result --------------------------------------------------------------------

def parent_reserved(parent: str, quantity: int = 50, event_id: str | None = None) -> dict:
    return {"type": "ParentReserved", "event_id": event_id or str(uuid.uuid4()),
            "idempotency_key": f"{parent}/ParentReserved/1", "parent_id": parent, "occurred_at_ms": now_ms(),
            "capacity": {"tokens": {"quantity": quantity, "kind": "logical"}}, "lease_ttl_ms": 3_600_000,
            "policy": POLICY}


def child_reserved(parent: str, child: str, quantity: int) -> dict:
    return {"type": "ChildReserved", "event_id": str(uuid.uuid4()), "idempotency_key": f"{parent}/{child}/reserve",
            "parent_id": parent, "occurred_at_ms": now_ms(), "child_id": child, "branch_id": child,
            "attempt_id": f"{child}1", "quantities": {"tokens": quantity}}


@pytest.mark.kafka
def test_publish_and_wait_returns_the_events_own_result(pipeline) -> None:
    producer = BranchEventProducer(pipeline.config, pipeline.topics.name("branch-events"))
    parent = f"wait-{uuid.uuid4().hex[:8]}"
    try:
        event = parent_reserved(parent)
        result = producer.publish_and_wait(event, timeout_s=30)
        assert (result.event_id, result.parent_id, result.event_type, result.result) == (
            event["event_id"], parent, "ParentReserved", "ok")
        assert result.applied and result.input_partition == partition_of(parent, 8)
        assert result.source.topic == pipeline.results_topic
        again = producer.publish_and_wait({**event, "event_id": str(uuid.uuid4())}, timeout_s=30)
        assert again.result == "duplicate" and not again.applied and again.input_offset > result.input_offset
        conflict = producer.publish_and_wait(parent_reserved(parent, quantity=51), timeout_s=30)
        assert conflict.result == "idempotency_conflict"
        events = [child_reserved(parent, "A", 30), child_reserved(parent, "B", 30), child_reserved(parent, "C", 20)]
        results = producer.publish_all_and_wait(events, timeout_s=30)
        assert [(r.event_id, r.child_id, r.result) for r in results] == [
            (events[0]["event_id"], "A", "ok"), (events[1]["event_id"], "B", "exceeds_available"),
            (events[2]["event_id"], "C", "ok")]
        # a typed method returns the event it sent; a ResultWaiter of one's own
        with ResultWaiter(pipeline.config, results_topic=pipeline.results_topic) as waiter:
            event_id = str(uuid.uuid4())
            expected = waiter.expect([{"parent_id": parent, "event_id": event_id,
                                       "idempotency_key": f"{parent}/A/A1/activate", "type": "ChildActivated"}])
            sent = producer.child_activated(parent, child_id="A", attempt_id="A1", lease_generation=1,
                                            lease_ttl_ms=600_000, idempotency_key=f"{parent}/A/A1/activate",
                                            occurred_at_ms=now_ms(), event_id=event_id)
            assert sent["event_id"] == event_id
            producer.flush()
            [activated] = waiter.wait(expected, timeout_s=30)
        assert (activated.event_id, activated.result) == (event_id, "ok")
    finally:
        producer.close()


@pytest.mark.kafka
def test_wait_for_a_result_times_out_cleanly_when_no_processor_answers(kafka_topics) -> None:
    config = {"bootstrap.servers": kafka_topics.bootstrap_servers}
    producer = BranchEventProducer(config, kafka_topics.name("branch-events"))
    parent = f"nobody-{uuid.uuid4().hex[:8]}"
    event = parent_reserved(parent)
    started = time.monotonic()
    with pytest.raises(ResultTimeout) as timeout:
        producer.publish_and_wait(event, timeout_s=2)
    elapsed = time.monotonic() - started
    assert 2 <= elapsed < 10
    error = timeout.value
    assert isinstance(error, SettlementError) and isinstance(error, TimeoutError)
    assert [e["event_id"] for e in error.pending] == [event["event_id"]] and error.results == []
    assert event["event_id"] in str(error) and kafka_topics.name("settlement-results") in str(error)
    assert "settle run" in str(error)
    # it was published, and the producer goes on
    producer.publish(parent_reserved(f"{parent}-2"))
    producer.close()
    inputs = [v for recs in read_partitions(kafka_topics.bootstrap_servers, kafka_topics.name("branch-events"),
                                            decode=False).values() for _, _, v in recs]
    assert len(inputs) == 2
    assert {default_codec().decode_event(v)["event_id"] for v in inputs} >= {event["event_id"]}


@pytest.mark.unit
def test_publish_and_wait_needs_a_results_topic() -> None:
    producer = BranchEventProducer({"bootstrap.servers": "127.0.0.1:1"}, "some-input")
    with pytest.raises(ConfigError, match="results_topic"):
        producer.publish_and_wait(parent_reserved("x"), timeout_s=1)


# -- faust ---------------------------------------------------------------------------------------------------

FAUST_APP = REPO / "examples" / "faust_releases.py"


@pytest.mark.kafka
def test_the_faust_example_applies_every_release_once_read_committed(pipeline, tmp_path: Path) -> None:
    failing = next(r for r in pipeline.releases if r.parent_id == pipeline.parents[1] and r.reason == "completed")
    name = group()
    db_path = tmp_path / "quota.db"
    env = {**os.environ, "SETTLE_BOOTSTRAP_SERVERS": pipeline.config["bootstrap.servers"],
           "SETTLE_TOPIC_PREFIX": pipeline.topics.prefix, "SETTLE_FAUST_GROUP": name, "SETTLE_FAUST_DB": str(db_path),
           "SETTLE_FAUST_DATADIR": str(tmp_path / "faust"), "SETTLE_FAUST_FAIL_FIRST": failing.dedupe_key}
    log = tmp_path / "faust.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(FAUST_APP), "worker", "--loglevel", "info"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 90
        while count_keys(db_path) < len(pipeline.release_records()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(0.5)
        time.sleep(2)  # more would come now, if any did
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert code == 0, output[-5000:]
    assert f"injected failure on {failing.dedupe_key}" in output  # retried in place, then applied
    db = sqlite3.connect(db_path)
    rows = db.execute("SELECT release_key, parent_id, destination, quantity FROM credited").fetchall()
    assert sorted(rows) == sorted((r.release_key, r.parent_id, r.destination, r.quantity) for r in pipeline.releases)
    assert sorted(db.execute("SELECT parent_id, outcome FROM settled_parents").fetchall()) == sorted(
        (p, "succeeded") for p in pipeline.parents)
    assert ABORTED_KEY not in {key for key, *_ in rows}  # read_committed: the aborted release never applied
    # the group's offsets: every partition committed past its last release, so a restart goes on after them
    last = defaultdict(int)
    for record in pipeline.release_records():
        last[record.source.partition] = max(last[record.source.partition], record.source.offset + 1)
    assert group_offsets(pipeline.config, name, pipeline.releases_topic) == last, output[-3000:]


@pytest.mark.kafka
def test_the_faust_example_stops_unacked_on_a_record_it_cannot_decode(kafka_bootstrap, kafka_admin, topic_prefix,
                                                                    tmp_path: Path) -> None:
    topic = topic_prefix + "capacity-releases"
    for future in kafka_admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(ADMIN_TIMEOUT_S)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topic, key=b"p", value=b"\xc3\x01" + b"\x00" * 8 + b"from a newer schema")
    producer.flush(30)
    name = group()
    env = {**os.environ, "SETTLE_BOOTSTRAP_SERVERS": kafka_bootstrap, "SETTLE_TOPIC_PREFIX": topic_prefix,
           "SETTLE_FAUST_GROUP": name, "SETTLE_FAUST_DB": str(tmp_path / "quota.db"),
           "SETTLE_FAUST_DATADIR": str(tmp_path / "faust")}
    run = subprocess.run([sys.executable, str(FAUST_APP), "worker", "--loglevel", "info"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert "stopping: " in output and "unknown writer schema fingerprint" in output
    assert count_keys(tmp_path / "quota.db") == 0
    assert group_offsets({"bootstrap.servers": kafka_bootstrap}, name, topic, partitions=1) == {}  # nothing committed past it


def count_keys(db_path: Path) -> int:
    if not db_path.exists():
        return 0
    try:
        with sqlite3.connect(db_path) as db:
            return db.execute("SELECT COUNT(*) FROM applied_settlement_keys").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def group_offsets(config: dict, group_id: str, topic: str, partitions: int = 8) -> dict[int, int]:
    consumer = Consumer({**config, "group.id": group_id, "enable.auto.commit": False})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in committed if tp.offset >= 0}
    finally:
        consumer.close()


# -- no broker: the codec, the stores, the settings ----------------------------------------------------------

def sample_release() -> CapacityReleased:
    balance = Balance("logical", 100, 50, 20, 0, 0, 0, 0, 30, 0)
    return CapacityReleased("wf/k/A/tokens/parent", "wf", "A", "A1", "tokens", 8, "parent", "completed", "wf/k",
                            "e-1", balance, 3, 17, 1_000)


def sample_settled() -> ParentSettled:
    return ParentSettled("wf", "succeeded", {"tokens": Balance("logical", 100, 0, 0, 0, 0, 0, 58, 42, 0)},
                         "wf/ParentClosed/1", "e-9", 3, 21, 2_000)


@pytest.mark.unit
def test_typed_records_round_trip_the_processors_bytes() -> None:
    codec = default_codec()
    for record in (sample_release(), sample_settled(),
                   SettlementResult("e-1", "wf/k", "wf", None, "ParentClosed", "ok", "", 3, 21, 2_000)):
        data = encode_output(record)
        assert data == codec.encode(record.kind, record.to_record())
        assert decode_output(data) == record and type(decode_output(data)) is type(record)
    assert sample_settled().dedupe_key == "wf/settled" and sample_release().dedupe_key == "wf/k/A/tokens/parent"
    assert len({sample_settled(), sample_settled()}) == 1  # hashable, dimensions and all
    with pytest.raises(UndecodableOutput, match="cannot decode"):
        decode_output(b"\xc3\x01garbage")
    audit = codec.encode("Balance", sample_release().balance.to_record())
    with pytest.raises(UndecodableOutput, match="a Balance record"):
        decode_output(audit)
    with pytest.raises(UndecodableOutput, match="without a value"):
        decode_output(None)


@pytest.mark.unit
def test_the_faust_codec_decodes_both_kinds_and_never_raises() -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import faust_releases
    finally:
        sys.path.pop(0)
    codec = faust_releases.SettlementAvroCodec()
    assert codec.loads(encode_output(sample_release())) == sample_release()
    assert codec.loads(encode_output(sample_settled())) == sample_settled()
    assert codec.dumps(sample_settled()) == encode_output(sample_settled())
    broken = codec.loads(b"\xc3\x01broken")
    assert isinstance(broken, faust_releases.Undecodable) and broken.data == b"\xc3\x01broken"
    assert faust_releases.faust_settings({"bootstrap.servers": "a:1,b:2"}) == {"broker": "kafka://a:1;kafka://b:2"}
    with pytest.raises(ConfigError, match="sasl.oauthbearer.config"):
        faust_releases.faust_settings({"bootstrap.servers": "a:1", "sasl.oauthbearer.config": "x"})


@pytest.mark.unit
def test_seen_keys_record_only_what_the_handler_applied(tmp_path: Path) -> None:
    memory = BoundedSeenKeys(max_keys=2)
    with memory.claim(["a", "b"]) as new:
        assert new == {"a", "b"}
    with pytest.raises(RuntimeError):
        with memory.claim(["c"]) as new:
            assert new == {"c"}
            raise RuntimeError
    assert "c" not in memory and "a" in memory
    with memory.claim(["b", "c"]) as new:
        assert new == {"c"}
    assert "a" not in memory and len(memory) == 2  # the oldest forgotten

    store = SqliteSeenKeys(str(tmp_path / "s.db"))
    store.connection.execute("CREATE TABLE effect (key TEXT)")
    with pytest.raises(RuntimeError):
        with store.claim(["k"]) as new:
            store.connection.execute("INSERT INTO effect VALUES ('k')")
            raise RuntimeError
    assert "k" not in store and store.connection.execute("SELECT COUNT(*) FROM effect").fetchone()[0] == 0
    with store.claim(["k"]) as new:
        assert new == {"k"}
        store.connection.execute("INSERT INTO effect VALUES ('k')")
    with store.claim(["k", "l"]) as new:
        assert new == {"l"}
    reopened = SqliteSeenKeys(str(tmp_path / "s.db"))
    assert "k" in reopened and "l" in reopened and len(reopened) == 2


@pytest.mark.unit
def test_the_consumer_refuses_settings_that_break_its_guarantee() -> None:
    base = {"bootstrap.servers": "127.0.0.1:1"}
    with pytest.raises(ConfigError, match="isolation.level"):
        SettlementConsumer({**base, "isolation.level": "read_uncommitted"}, group_id="g-unit")
    with pytest.raises(ConfigError, match="enable.auto.commit"):
        SettlementConsumer({**base, "enable.auto.commit": True}, group_id="g-unit")
    with pytest.raises(ConfigError, match="group_id"):
        SettlementConsumer(base, group_id="")
