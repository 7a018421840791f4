"""Operating the processor: its own ticks drive expiry, metrics, the typed producer, and a partition stopped
by an invariant violation while the others go on."""

from __future__ import annotations

import socket
import re
import time
import urllib.request
from pathlib import Path

import pytest

from branch_settlement.processors.kafka.clients import BranchEventProducer, read_outputs
from branch_settlement.projections import keys
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas.codec import default_codec
from tests.kafka.pipeline import ProcessorProcess, example_events, read_partitions, wait_for_results
from tests.kafka.test_processor import produce_file

pytestmark = pytest.mark.kafka

POLICY = {"max_live_children": 4, "reconciliation_timeout_ms": 600_000, "lending_limit": {}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def now_ms() -> int:
    return int(time.time() * 1000)


def audits(kafka_topics) -> list[dict]:
    return [r for recs in read_partitions(kafka_topics.bootstrap_servers, kafka_topics.name("settlement-audit"))
            .values() for _, _, r in recs]


def test_processor_ticks_expire_leases_and_metrics_are_served(kafka_topics, tmp_path: Path) -> None:
    port = free_port()
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=("--tick-interval-ms", "200", "--metrics-port", str(port)))
    try:
        producer = BranchEventProducer({"bootstrap.servers": kafka_topics.bootstrap_servers},
                                       kafka_topics.name("branch-events"))
        producer.parent_reserved("job-1", capacity={"gpu_s": {"quantity": 50, "kind": "logical"}},
                                 lease_ttl_ms=3_600_000, policy=POLICY, idempotency_key="job-1/p",
                                 occurred_at_ms=now_ms())
        producer.child_reserved("job-1", child_id="x", branch_id="x", attempt_id="x1", quantities={"gpu_s": 30},
                                idempotency_key="job-1/x/r", occurred_at_ms=now_ms())
        producer.child_activated("job-1", child_id="x", attempt_id="x1", lease_generation=1, lease_ttl_ms=1_500,
                                 idempotency_key="job-1/x/a", occurred_at_ms=now_ms())
        producer.flush()
        deadline = time.monotonic() + 60
        while not any(a["child_id"] == "x" and a["new_state"] == "reconciling" for a in audits(kafka_topics)):
            assert time.monotonic() < deadline, "the lease never expired:\n" + proc.output()[-3000:]
            assert proc.proc.poll() is None, proc.output()[-3000:]
            time.sleep(1)
        producer.usage_reported("job-1", child_id="x", attempt_id="x1", lease_generation=1, usage_report_id="late",
                                usage={"gpu_s": 7}, final=True, idempotency_key="job-1/x/late",
                                occurred_at_ms=now_ms())
        producer.flush()
        deadline = time.monotonic() + 60
        while True:
            released = [o.record for o in read_outputs({"bootstrap.servers": kafka_topics.bootstrap_servers},
                                                       [kafka_topics.name("capacity-releases")], idle_timeout_s=1)]
            if released:
                break
            assert time.monotonic() < deadline, proc.output()[-3000:]
        assert [(r["child_id"], r["quantity"], r["destination"], r["reason"]) for r in released] == [
            ("x", 23, "parent", "final_usage")]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert 'settle_events_total{result="ok"}' in metrics
    assert 'settle_transactions_total{outcome="committed"}' in metrics
    assert 'settle_capacity{dimension="gpu_s",term="committed"} 7.0' in metrics
    assert 'settle_released_quantity_total{destination="parent",dimension="gpu_s"} 23.0' in metrics
    last_commit = re.search(r"^settle_last_commit_timestamp_seconds (\S+)$", metrics, re.M)
    assert last_commit and abs(float(last_commit.group(1)) - time.time()) < 120
    assert "settle_transactional_calls_stuck 0.0" in metrics
    checkpoints = re.search(r"^settle_checkpoint_duration_seconds_count (\S+)$", metrics, re.M)
    assert checkpoints and float(checkpoints.group(1)) >= 2  # at least the two checkpoints of the releases


def test_an_invariant_violation_stops_only_its_partition(kafka_topics, tmp_path: Path, worked_example: Path) -> None:
    state = tmp_path / "state"
    proc = ProcessorProcess(kafka_topics, state, tmp_path / "run.log", slot="a", group="g")
    events = example_events(worked_example, tmp_path)
    try:
        assert produce_file(kafka_topics, events).returncode == 0
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, 13, 90, [proc])
    finally:
        assert proc.stop() == 0
    # Corrupt wf-42's committed ledger behind the processor's back, as a bug in an earlier version would.
    codec = default_codec()
    [path] = [p for p in (state / "g").glob("partition-*")
              if RocksStore(p, read_only=True).get(keys.parent_key("wf-42")) is not None]
    store = RocksStore(path)
    name, parent = codec.decode(store.get(keys.parent_key("wf-42")))
    parent["dimensions"]["tokens"]["available"] += 1
    store.write([(keys.parent_key("wf-42"), codec.encode(name, parent))], store.changelog_offset())
    store.close()
    stopped_partition = int(path.name.split("-")[1])

    producer = BranchEventProducer({"bootstrap.servers": kafka_topics.bootstrap_servers},
                                   kafka_topics.name("branch-events"))
    producer.parent_closed("wf-42", outcome="succeeded", idempotency_key="wf-42/close", occurred_at_ms=now_ms())
    for i in range(12):
        producer.parent_reserved(f"other-{i}", capacity={"tokens": {"quantity": 5, "kind": "logical"}},
                                 lease_ttl_ms=3_600_000, policy=POLICY, idempotency_key=f"other-{i}/p",
                                 occurred_at_ms=now_ms())
    producer.flush()
    inputs = read_partitions(kafka_topics.bootstrap_servers, kafka_topics.name("branch-events"), decode=False)
    elsewhere = {key.decode() for p, recs in inputs.items() if p != stopped_partition for _, key, _ in recs
                 if key and key.startswith(b"other-")}
    assert elsewhere, "no parent landed outside the stopped partition"
    proc = ProcessorProcess(kafka_topics, state, tmp_path / "run2.log", slot="a", group="g")
    try:
        results = lambda: [r for recs in read_partitions(kafka_topics.bootstrap_servers,
                                                         kafka_topics.name("settlement-results")).values()
                           for _, _, r in recs]
        deadline = time.monotonic() + 60
        while {r["parent_id"] for r in results()} < elsewhere or "STOPPED" not in proc.output():
            assert time.monotonic() < deadline, proc.output()[-3000:]
            time.sleep(1)
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert f"PARTITION {stopped_partition} STOPPED" in proc.output()
    assert "invariant violated for parent 'wf-42'" in proc.output()
    settled = results()
    assert not any(r["idempotency_key"] == "wf-42/close" for r in settled)  # the stopped partition committed nothing
    assert all(r["result"] == "ok" for r in settled if r["parent_id"] in elsewhere)
