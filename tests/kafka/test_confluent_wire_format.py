"""The Confluent wire format end to end through the broker (docs/wire-formats.md): events published as
Confluent frames (`settle produce --wire-format confluent`), folded by `settle run --wire-format confluent`,
whose outputs are Confluent frames with the registry's ids; Apache Avro's Java library reads what the
processor published; `settle replay --topic` with the registry agrees, and without it cannot read the frames.

The registry here is a registry snapshot file (`--schema-registry-url file:PATH`): no Schema Registry can be
run from the package registries this project's machines reach (docs/wire-formats.md says what was tried)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from branch_settlement.processors.kafka import wire
from branch_settlement.processors.replay.replayer import read_jsonl
from branch_settlement.processors.workload import write_jsonl
from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.confluent import EXTERNAL_TYPES, ConfluentCodec, frame, standalone_schemas
from tests.interop import test_java_interop as java
from tests.interop.vectors import avro_json
from tests.kafka.pipeline import REPO, ProcessorProcess, read_partitions

pytestmark = pytest.mark.kafka

avro_classpath = java.avro_classpath  # the fixture: Apache Avro's Java library, from Maven Central


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A registry snapshot with every external record's schema, under ids of its own (not 1, 2, ...)."""
    schemas = standalone_schemas()
    codec = default_codec()
    path = tmp_path / "registry.json"
    wire.write_snapshot(str(path), [(100 + i, codec.version(name).fullname, schemas[name])
                                    for i, name in enumerate(sorted(EXTERNAL_TYPES))])
    return path


def connection(kafka_topics) -> tuple[str, ...]:
    return ("--bootstrap-servers", kafka_topics.bootstrap_servers, "--topic-prefix", kafka_topics.prefix)


def input_results(bootstrap: str, kafka_topics, codec: ConfluentCodec) -> int:
    rows = read_partitions(bootstrap, kafka_topics.name("settlement-results"), decode=False)
    return sum(1 for recs in rows.values() for _, _, raw in recs if codec.decode(raw)[1]["parent_id"])


def test_confluent_frames_in_and_out_read_by_java_and_replayed(kafka_topics, tmp_path, snapshot,
                                                              avro_classpath) -> None:
    registry = ("--wire-format", "confluent", "--schema-registry-url", f"file:{snapshot}")
    codec = ConfluentCodec(wire.read_snapshot(str(snapshot)))
    ids = {r.name: r.schema_id for r in codec.check_and_register()}
    events = tmp_path / "events.jsonl"
    write_jsonl(str(events), 21, 1_500, ticks=False)
    sent = sum(1 for item in read_jsonl(str(events), default_codec()) if item.event is not None)
    produced = settle("produce", str(events), *connection(kafka_topics), *registry)
    assert produced.returncode in (0, 1), produced.stderr  # 1: the workload's malformed lines, refused
    inputs = [raw for recs in read_partitions(kafka_topics.bootstrap_servers, kafka_topics.name("branch-events"),
                                              decode=False).values() for _, _, raw in recs]
    assert len(inputs) == sent and all(raw[:1] == b"\x00" for raw in inputs)
    assert {int.from_bytes(raw[1:5], "big") for raw in inputs} <= {ids[n] for n in EXTERNAL_TYPES}

    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=registry)
    try:
        deadline = time.monotonic() + 300
        while input_results(kafka_topics.bootstrap_servers, kafka_topics, codec) < sent:
            assert proc.proc.poll() is None, proc.output()[-3000:]
            assert time.monotonic() < deadline, "results not all committed"
            time.sleep(1)
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert "subjects checked and registered" in proc.output()

    # Every output the processor published is a Confluent frame of the snapshot's ids; the dead letters of
    # nothing (every input decoded).
    published = {}
    for topic in ("settlement-results", "capacity-releases", "settlement-audit"):
        for recs in read_partitions(kafka_topics.bootstrap_servers, kafka_topics.name(topic), decode=False).values():
            for _, _, raw in recs:
                assert raw[:1] == b"\x00", topic
                name, record = codec.decode(raw)
                assert int.from_bytes(raw[1:5], "big") == ids[name]
                published.setdefault(name, (raw, record))
    assert {"SettlementResult", "CapacityReleased", "ParentSettled", "AuditRecord"} <= set(published)

    # Apache Avro's Java library reads those very bytes: the first record of each kind the processor published.
    schemas = standalone_schemas()
    single = default_codec()
    vectors = tmp_path / "published.jsonl"
    vectors.write_text("".join(json.dumps({
        "name": name, "fullname": single.version(name).fullname, "schema_id": ids[name], "schema": schemas[name],
        "avro_json": avro_json(schemas[name], record), "single_object": single.encode(name, record).hex(),
        "confluent": raw.hex()}) + "\n" for name, (raw, record) in sorted(published.items())))
    done = java.check(avro_classpath, vectors)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == f"{len(published)} passed, 0 failed"

    # The audit replay reads the frames with the registry and agrees; without it, it cannot read them.
    agreed = settle("replay", "--topic", "branch-events", *connection(kafka_topics), "--group-id", "g",
                    "--schema-registry-url", f"file:{snapshot}")
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr
    assert "AGREES" in agreed.stdout
    blind = settle("replay", "--topic", "branch-events", *connection(kafka_topics), "--group-id", "g")
    assert blind.returncode == 2, blind.stdout + blind.stderr
    assert "a Confluent wire format frame (schema id" in blind.stderr
    assert "needs the Schema Registry (--schema-registry-url" in blind.stderr


def test_a_frame_of_an_unknown_id_is_a_dead_letter_and_the_partition_goes_on(kafka_topics, tmp_path,
                                                                            snapshot) -> None:
    from confluent_kafka import Producer

    registry = ("--wire-format", "confluent", "--schema-registry-url", f"file:{snapshot}")
    codec = ConfluentCodec(wire.read_snapshot(str(snapshot)))
    codec.check_and_register()
    producer = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers})
    good = default_codec().event_from_json({
        "type": "ParentReserved", "event_id": "e1", "idempotency_key": "P1/ParentReserved/1", "parent_id": "P1",
        "occurred_at_ms": 1, "capacity": {"tokens": {"quantity": 10, "kind": "logical"}}, "lease_ttl_ms": 60_000,
        "policy": {"max_live_children": 4, "reconciliation_timeout_ms": 60_000, "lending_limit": {}}})
    framed = codec.encode_event(good)
    stranger = frame(7, framed[5:])  # an id the registry does not have
    topic = kafka_topics.name("branch-events")
    from branch_settlement.schemas.partitioning import partition_of

    partitions = len(producer.list_topics(topic, timeout=10).topics[topic].partitions)
    p = partition_of("P1", partitions)
    producer.produce(topic, value=stranger, key=b"P1", partition=p)
    producer.produce(topic, value=framed, key=b"P1", partition=p)
    assert producer.flush(30) == 0
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=registry)
    try:
        deadline = time.monotonic() + 120
        while input_results(kafka_topics.bootstrap_servers, kafka_topics, codec) < 1:
            assert proc.proc.poll() is None, proc.output()[-3000:]
            assert time.monotonic() < deadline, "the good event after the stranger got no result"
            time.sleep(1)
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    letters = [codec.decode(raw)[1] for recs in read_partitions(
        kafka_topics.bootstrap_servers, kafka_topics.name("branch-events-dlq"), decode=False).values()
        for _, _, raw in recs]
    assert [letter["reason"] for letter in letters] == ["schema id 7 is not in the schema registry"]
    assert letters[0]["original"] == stranger
