"""Audit replay against the topics (`settle replay --topic`) and from an export file (`settle export`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Producer

from branch_settlement.processors.kafka import topics
from branch_settlement.schemas.codec import default_codec
from tests.kafka.pipeline import REPO, ProcessorProcess, read_partitions, wait_for_results
from tests.kafka.test_processor import produce_workload
from tests.kafka.test_replay_lag import commit_input_ends

pytestmark = pytest.mark.kafka


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=600)


@pytest.fixture
def processed(kafka_topics, tmp_path: Path):
    """A committed run of a 5k-event workload, the processor stopped afterwards."""
    expected = produce_workload(kafka_topics, tmp_path, 5_000, seed=21)
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g")
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    return tmp_path / "state"


def test_replay_of_a_clean_run_agrees(kafka_topics, processed: Path) -> None:
    run = settle("replay", "--topic", "branch-events", "--topic-prefix", kafka_topics.prefix, "--bootstrap-servers",
                 kafka_topics.bootstrap_servers, "--state-dir", str(processed), "--group-id", "g")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "AGREES" in run.stdout and "and the live ledgers" in run.stdout


def test_replay_against_a_running_processor_agrees(kafka_topics, tmp_path: Path) -> None:
    """The processor waits for input and goes on ticking at the input's end while the replay reads: its
    tick results there, committed after the replay read ledger-ticks, are its work since, not extras."""
    expected = produce_workload(kafka_topics, tmp_path, 2_000, seed=22)
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g")
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [proc])
        for _ in range(2):
            run = settle("replay", "--topic", "branch-events", "--topic-prefix", kafka_topics.prefix,
                         "--bootstrap-servers", kafka_topics.bootstrap_servers)
            assert run.returncode == 0, run.stdout + run.stderr
            assert "AGREES" in run.stdout
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


def copy_with_tampering(kafka_topics, admin, prefix: str):
    """Copy every topic to `prefix`, altering one release, removing one, injecting one; return where."""
    spec = topics.load_spec(prefix=prefix)
    topics.apply(admin, spec)
    codec = default_codec()
    # idempotent: a copy keeps each partition's order (a retried batch must not overtake a later one)
    producer = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers, "enable.idempotence": True})
    offsets: dict[str, tuple] = {}
    done: set[str] = set()  # decided when produced; `offsets` is filled when delivered

    def remember(label):
        def delivered(err, msg):
            assert err is None
            offsets[label] = (msg.partition(), msg.offset())
        return delivered

    for logical in ("branch-events", "ledger-ticks", "settlement-results", "settlement-audit", "branch-events-dlq",
                    "capacity-releases"):
        source = read_partitions(kafka_topics.bootstrap_servers, kafka_topics.name(logical), decode=False)
        target = spec.topic(logical).name
        for p, records in source.items():
            releases = 0
            for _, key, value in records:
                if logical == "capacity-releases":
                    kind, record = codec.decode(value)
                    if kind == "CapacityReleased":
                        releases += 1
                        if releases == 3 and "altered" not in done:
                            done.add("altered")
                            record = dict(record, quantity=record["quantity"] + 1)
                            producer.produce(target, codec.encode(kind, record), key, partition=p,
                                             on_delivery=remember("altered"))
                            continue
                        if releases == 5 and "removed" not in done:
                            done.add("removed")
                            offsets["removed"] = (p, record["input_offset"])
                            continue
                        if releases == 7 and "injected" not in done:
                            done.add("injected")
                            producer.produce(target, value, key, partition=p)
                            producer.produce(target, value, key, partition=p, on_delivery=remember("injected"))
                            continue
                producer.produce(target, value, key, partition=p)
            producer.flush(60)
    assert {"altered", "removed", "injected"} <= set(offsets)
    return offsets


def test_a_tampered_copy_is_detected_and_pinpointed(kafka_topics, kafka_admin, processed: Path) -> None:
    prefix = kafka_topics.prefix + "tampered."
    where = copy_with_tampering(kafka_topics, kafka_admin, prefix)
    # the copy's input as a processor's group would have committed it: every input folded, so an output
    # missing there is missing, not the processors' lag (tests/kafka/test_replay_lag.py)
    commit_input_ends(kafka_topics.bootstrap_servers, "copy", f"{prefix}branch-events")
    run = settle("replay", "--topic", "branch-events", "--topic-prefix", prefix, "--bootstrap-servers",
                 kafka_topics.bootstrap_servers, "--group-id", "copy")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES: 3 divergences" in run.stdout, run.stdout
    releases = f"{prefix}capacity-releases"
    p, offset = where["altered"]
    assert f"different {releases}[{p}]@{offset}" in run.stdout
    p, input_offset = where["removed"]
    assert f"missing   {releases}[{p}] (input offset {input_offset})" in run.stdout
    p, offset = where["injected"]
    assert f"extra     {releases}[{p}]@{offset}" in run.stdout
    # one process or several, the same divergences in the same order
    alone = settle("replay", "--topic", "branch-events", "--topic-prefix", prefix, "--bootstrap-servers",
                   kafka_topics.bootstrap_servers, "--jobs", "1", "--group-id", "copy")
    assert alone.returncode == 1 and alone.stdout.splitlines()[1:] == run.stdout.splitlines()[1:], alone.stdout


def test_replay_from_an_export_equals_replay_from_the_topic(kafka_topics, processed: Path, tmp_path: Path) -> None:
    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    export = settle("export", "-o", str(tmp_path / "events.avro"), *common)
    assert export.returncode == 0, export.stderr
    from_topic = settle("replay", "--topic", "branch-events", "--json", *common)
    from_file = settle("replay", str(tmp_path / "events.avro"), "--json")
    assert from_topic.returncode == 0 and from_file.returncode == 0, from_topic.stderr + from_file.stderr
    topic_doc = json.loads(from_topic.stdout)
    assert topic_doc.pop("crosscheck")["agrees"]  # the cross-check's own report, only from the topic
    assert from_file.stdout == json.dumps(topic_doc, indent=2, ensure_ascii=False) + "\n"
    doc = json.loads(from_file.stdout)
    assert doc["results"] and doc["releases"]
    assert len(doc["dead_letters"]) == 3  # the undecodable records, with their partition and offset


def test_audit_of_a_parent_from_the_topic_matches_the_projection(kafka_topics, processed: Path,
                                                                 tmp_path: Path) -> None:
    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    run = settle("audit", "wf-000003", "--topic", "branch-events", "--html", str(tmp_path / "r.html"), *common)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Parent wf-000003  status closed")
    inspect = settle("inspect", "wf-000003", "--state-dir", str(processed), "--group-id", "g", "--json")
    live = json.loads(inspect.stdout)["parent"]["dimensions"]["tokens"]
    html = (tmp_path / "r.html").read_text()
    chart = json.loads(html.split('<script type="application/json" id="chart-data">')[1].split("</script>")[0])
    last = chart["dimensions"]["tokens"]["points"][-1]
    assert {term: last[term] for term in live if term != "kind"} == {t: v for t, v in live.items() if t != "kind"}
