"""`settle replay --topic` tells the processors' lag from missing output, against the real broker: outputs of
inputs beyond the processors' group's committed offsets are "not yet processed" (exit 0); once the processor
caught up the replay agrees; an output really missing below the committed offsets is "missing" (exit 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from branch_settlement.processors.kafka import topics
from branch_settlement.processors.workload import write_jsonl
from tests.kafka.pipeline import REPO, ProcessorProcess, count_records, wait_for_results

pytestmark = pytest.mark.kafka


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def produce(bootstrap: str, prefix: str, path: Path) -> None:
    run = settle("produce", str(path), "--bootstrap-servers", bootstrap, "--topic-prefix", prefix)
    assert run.returncode in (0, 1) and "published" in run.stdout, run.stdout + run.stderr


def commit_input_ends(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """Commit `group`'s offsets of `topic` at the topic's ends, as a processor that folded everything would
    have (without publishing any output): return the offsets."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        consumer.commit(offsets=[TopicPartition(topic, p, end) for p, end in ends.items() if end > 0],
                        asynchronous=False)
        return ends
    finally:
        consumer.close()


def replay(kafka_topics, *args: str, prefix: str | None = None) -> subprocess.CompletedProcess:
    return settle("replay", "--topic", "branch-events", "--topic-prefix", prefix or kafka_topics.prefix,
                  "--bootstrap-servers", kafka_topics.bootstrap_servers, *args)


def test_lag_is_not_yet_processed_and_agrees_once_caught_up(kafka_topics, tmp_path: Path) -> None:
    bootstrap = kafka_topics.bootstrap_servers
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    write_jsonl(str(first), 31, 600)
    write_jsonl(str(second), 32, 400)
    produce(bootstrap, kafka_topics.prefix, first)
    inputs = count_records(bootstrap, kafka_topics.name("branch-events"))

    # no processor yet: every input is beyond the group's (empty) committed offsets
    run = replay(kafka_topics, "--group-id", "g")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"NOT YET PROCESSED: {inputs:,} input records beyond the committed offsets of group g" in run.stdout
    assert "AGREES" in run.stdout and "missing" not in run.stdout
    doc = json.loads(replay(kafka_topics, "--group-id", "g", "--json").stdout)["crosscheck"]
    assert doc["agrees"] and not doc["divergences"]
    assert doc["not_yet_processed"]["group_id"] == "g" and doc["not_yet_processed"]["inputs"] == inputs
    assert doc["not_yet_processed"]["outputs"] == len(doc["not_yet_processed"]["expected"]) >= inputs
    assert {d["problem"] for d in doc["not_yet_processed"]["expected"]} == {"not yet processed"}

    # the processor folds the first file, then stops; the second file is published after it
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g")
    try:
        wait_for_results(bootstrap, kafka_topics, inputs, 300, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    produce(bootstrap, kafka_topics.prefix, second)
    later = count_records(bootstrap, kafka_topics.name("branch-events")) - inputs
    run = replay(kafka_topics, "--group-id", "g")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"NOT YET PROCESSED: {later:,} input records beyond the committed offsets of group g" in run.stdout
    assert "AGREES: every output the processors committed matches the replay" in run.stdout

    # caught up: agrees, nothing pending
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g")
    try:
        wait_for_results(bootstrap, kafka_topics, inputs + later, 300, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    run = replay(kafka_topics, "--group-id", "g")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "AGREES: every output and ledger matches the replay" in run.stdout
    assert "NOT YET PROCESSED" not in run.stdout
    doc = json.loads(replay(kafka_topics, "--group-id", "g", "--json").stdout)["crosscheck"]
    assert doc["agrees"] and doc["not_yet_processed"]["inputs"] == 0 and not doc["not_yet_processed"]["expected"]

    # an audit by the other implementation (docs/implementations.md): the live run, compiled (the default where
    # it is built, as `make install` builds it here), re-derived by the pure-Python reference
    assert "implementation compiled (branch-settlement-native" in proc.output()
    assert "implementation compiled (branch-settlement-native" in run.stdout
    run = settle("--implementation", "python", "replay", "--topic", "branch-events", "--topic-prefix",
                 kafka_topics.prefix, "--bootstrap-servers", bootstrap, "--group-id", "g")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "AGREES: every output and ledger matches the replay" in run.stdout
    assert "implementation python (the pure-Python reference)" in run.stdout


def test_outputs_missing_below_the_committed_offsets_are_missing(kafka_topics, kafka_admin, tmp_path: Path) -> None:
    """The input alone, with a group's offsets committed at its end as if a processor had folded it: every
    output the replay expects is missing, and the replay diverges; another group's view is only lag."""
    bootstrap = kafka_topics.bootstrap_servers
    prefix = kafka_topics.prefix + "bare."  # deleted with the test's own topics
    assert not topics.has_drift(topics.apply(kafka_admin, topics.load_spec(prefix=prefix), timeout_s=30))
    events = tmp_path / "events.jsonl"
    write_jsonl(str(events), 33, 200)
    produce(bootstrap, prefix, events)
    commit_input_ends(bootstrap, "claims-everything", prefix + "branch-events")
    run = replay(kafka_topics, "--group-id", "claims-everything", prefix=prefix)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES" in run.stdout and "missing   " in run.stdout and "NOT YET PROCESSED" not in run.stdout
    doc = json.loads(replay(kafka_topics, "--group-id", "claims-everything", "--json", prefix=prefix).stdout)
    assert not doc["crosscheck"]["agrees"] and doc["crosscheck"]["not_yet_processed"]["inputs"] == 0
    assert {d["problem"] for d in doc["crosscheck"]["divergences"]} == {"missing"}
    idle = replay(kafka_topics, "--group-id", "never-ran", prefix=prefix)
    assert idle.returncode == 0 and "NOT YET PROCESSED" in idle.stdout, idle.stdout + idle.stderr
