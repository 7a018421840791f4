"""Helpers for end-to-end tests of `settle run` against the real broker: run processors as separate
processes (so they can be killed, paused and resumed; they tick from the system clock, as in production),
read topics back read_committed, and fold what they folded offline (the committed input with their ticks of
ledger-ticks merged in), partition by partition, for comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, TopicPartition

from branch_settlement.processors.crosscheck.readers import reached, read_folded_inputs
from branch_settlement.processors.kafka.clients import high_watermark
from branch_settlement.processors.replay.replayer import ledger_snapshot, replay
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas.codec import default_codec

REPO = Path(__file__).resolve().parents[2]
# The processors' own ticks: often enough that every test folds many, and that they fall between events,
# across checkpoints, kills and rebalances.
TICK_INTERVAL_MS = "200"


class ProcessorProcess:
    def __init__(self, kafka_topics, state_dir: Path, log_path: Path, *, slot: str, group: str,
                 extra_env: dict | None = None, extra_args: tuple = ()) -> None:
        self.log_path = log_path
        args = [sys.executable, "-m", "branch_settlement.processors.cli.main", "run", "--bootstrap-servers", kafka_topics.bootstrap_servers,
                "--topic-prefix", kafka_topics.prefix, "--state-dir", str(state_dir), "--group-id", group,
                "--worker-slot", slot, "--tick-interval-ms", TICK_INTERVAL_MS, "--session-timeout-ms", "6000",
                "--commit-interval-ms", "100", *extra_args]
        env = {**os.environ, **(extra_env or {})}
        self.log = open(log_path, "ab")
        self.log_start = self.log.tell()  # the log may hold earlier runs of the same slot
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, once `settle run` has its drain handler: a signal while the interpreter is still importing
        ends it the default way (-15), which is not what these tests are about."""
        self.wait_started(timeout_s)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout_s)
        self.log.close()
        return code

    def wait_started(self, timeout_s: float) -> None:
        """Until the processor logged its first line ("settle run: ..."; its drain handler is installed before
        that), or exited."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_start)
                if b"settle run: " in log.read():
                    return
            time.sleep(0.05)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def read_partitions(bootstrap: str, topic: str, decode: bool = True) -> dict[int, list]:
    """Every committed record of a topic up to its ends when reading began, per partition in offset order:
    (offset, key, value or decoded)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "test-reader", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True})
    codec = default_codec()
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        end = {p: high_watermark(consumer, TopicPartition(topic, p)) for p in partitions}
        pending = {p for p in partitions if end[p] > 0}
        consumer.assign([TopicPartition(topic, p, -2) for p in pending])
        records: dict[int, list] = defaultdict(list)
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=5_000, timeout=0.2):
                if message.error():
                    if message.error().code() == KafkaError._PARTITION_EOF:
                        pending.discard(message.partition())
                        continue
                    raise AssertionError(message.error().str())
                if message.offset() >= end[message.partition()]:
                    continue
                value = codec.decode(message.value())[1] if decode else message.value()
                records[message.partition()].append((message.offset(), message.key(), value))
            pending -= reached(consumer, topic, pending, end)
        assert not pending, f"{topic}: partitions {pending} never reached their end"
        return dict(records)
    finally:
        consumer.close()


def count_records(bootstrap: str, topic: str) -> int:
    return sum(len(v) for v in read_partitions(bootstrap, topic, decode=False).values())


def is_input_result(result: dict) -> bool:
    """Whether a result answers an input record, not one of the processor's own ticks (a Tick among the
    input is always `tick_not_accepted`)."""
    return result["event_type"] != "Tick" or result["result"] == "tick_not_accepted"


def count_input_results(bootstrap: str, kafka_topics) -> int:
    return sum(is_input_result(r) for recs in read_partitions(bootstrap, kafka_topics.name("settlement-results")).values()
               for _, _, r in recs)


def example_events(example: Path, directory: Path) -> Path:
    """A copy of a JSON Lines example without its Tick lines: ledger time is the processor's to make."""
    events = directory / f"{example.stem}.events.jsonl"
    events.write_text("".join(line for line in example.read_text().splitlines(keepends=True)
                              if line.strip() and json.loads(line)["type"] != "Tick"))
    return events


def topic_names(kafka_topics) -> dict[str, str]:
    return {topic.logical_name: topic.name for topic in kafka_topics.spec.topics}


def offline(bootstrap: str, kafka_topics, stores_dir: Path | None = None):
    """Fold what the processors folded offline, partition by partition: the committed input with their
    ticks merged in, with the topic's partition count; (results, releases, ledgers, dead letters) keyed by
    partition, exactly as `settle replay --topic` folds each partition."""
    codec = default_codec()
    partitions = kafka_topics.spec.topic("branch-events").partitions
    inputs = read_folded_inputs({"bootstrap.servers": bootstrap}, topic_names(kafka_topics), list(range(partitions)),
                                codec)
    results, releases, ledgers, dead = {}, {}, {}, {}
    for partition, items in inputs.items():
        result, store = replay(items, codec=codec, partition=partition, partitions=partitions)
        results[partition] = [(r["event_id"], r["result"], r["input_offset"]) for r in result.outputs.results]
        releases[partition] = [_release(r) for r in result.outputs.releases]
        ledgers[partition] = ledger_snapshot(store, codec)
        dead[partition] = [letter["offset"] for letter in result.dead_letters]
    return results, releases, ledgers, dead


def _release(r: dict) -> tuple:
    return (r["release_key"], r["parent_id"], r["child_id"], r["dimension"], r["quantity"], r["destination"],
            r["input_offset"])


def published(bootstrap: str, kafka_topics):
    """What the processors committed: results and releases per partition, in offset order."""
    results = {p: [(r["event_id"], r["result"], r["input_offset"]) for _, _, r in recs]
               for p, recs in read_partitions(bootstrap, kafka_topics.name("settlement-results")).items()}
    releases = {p: [_release(r) for _, _, r in recs if "release_key" in r]
                for p, recs in read_partitions(bootstrap, kafka_topics.name("capacity-releases")).items()}
    dead = {p: [r["offset"] for _, _, r in recs]
            for p, recs in read_partitions(bootstrap, kafka_topics.name("branch-events-dlq")).items()}
    return results, releases, dead


def wait_for_results(bootstrap: str, kafka_topics, expected: int, timeout_s: float, procs=()) -> None:
    """Until `expected` results of input records are committed (the processors' tick results not counted), or
    a processor died, or time ran out."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        seen = count_input_results(bootstrap, kafka_topics)
        if seen >= expected:
            return
        for proc in procs:
            if proc.proc.poll() is not None:
                raise AssertionError(f"processor exited with {proc.proc.returncode}:\n{proc.output()[-3000:]}")
        time.sleep(1)
    raise AssertionError(f"only {seen} of {expected} results committed in {timeout_s} s")


def projection_ledgers(state_dir: Path, group: str) -> dict[int, dict]:
    codec = default_codec()
    ledgers = {}
    for path in sorted((state_dir / group).glob("partition-*")):
        store = RocksStore(path, read_only=True)
        try:
            ledgers[int(path.name.split("-")[1])] = ledger_snapshot(store, codec)
        finally:
            store.close()
    return ledgers


def non_empty(per_partition: dict) -> dict:
    return {p: v for p, v in per_partition.items() if v}
