"""Retention through the broker (docs/contract.md "Retention", decision 22): a parent closes, the processor's
ticks (its clock file) pass the retention, the parent is compacted: the changelog holds null-value records
(tombstones) for its children and idempotency records, read back here; a late redelivery and a late report get
`parent_closed`; a second processor restoring from the changelog has the same projection; and
`settle replay --topic` agrees with everything published."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from branch_settlement.projections import keys, model
from branch_settlement.schemas.codec import default_codec
from tests.harness import T0
from tests.kafka.pipeline import (REPO, ProcessorProcess, projection_ledgers, read_partitions, wait_for_results)

pytestmark = pytest.mark.kafka

PARENT = "wf-retained"


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def event(etype: str, n: int, key: str, **fields) -> dict:
    return {"type": etype, "event_id": f"{PARENT}-{n}", "idempotency_key": key, "parent_id": PARENT,
            "occurred_at_ms": T0, **fields}


OPENING = [
    event("ParentReserved", 1, f"{PARENT}/ParentReserved/1", lease_ttl_ms=3_600_000,
          capacity={"tokens": {"quantity": 100, "kind": "logical"}},
          policy={"max_live_children": 8, "reconciliation_timeout_ms": 600_000, "lending_limit": {}}),
    event("ChildReserved", 2, f"{PARENT}/A/A1/reserve", child_id="A", branch_id="A", attempt_id="A1",
          quantities={"tokens": 40}),
    event("ChildActivated", 3, f"{PARENT}/A/A1/activate", child_id="A", attempt_id="A1", lease_generation=1,
          lease_ttl_ms=60_000),
    event("ChildCompleted", 4, f"{PARENT}/A/A1/1", child_id="A", attempt_id="A1", lease_generation=1,
          usage={"tokens": 25}),
    event("ParentClosed", 5, f"{PARENT}/ParentClosed/1", outcome="succeeded"),
]
LATE = [
    dict(OPENING[4], event_id=f"{PARENT}-6"),  # a redelivery of the close: its idempotency record is gone
    dict(OPENING[3], event_id=f"{PARENT}-7"),  # a redelivered report
    event("ParentReserved", 8, f"{PARENT}/ParentReserved/2", lease_ttl_ms=3_600_000,  # the id reused
          capacity={"tokens": {"quantity": 100, "kind": "logical"}},
          policy={"max_live_children": 8, "reconciliation_timeout_ms": 600_000, "lending_limit": {}}),
]


def write_lines(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def changelog(kafka_topics) -> list[tuple[bytes, bytes | None]]:
    return [(key, value) for recs in read_partitions(kafka_topics.bootstrap_servers,
                                                     kafka_topics.name("ledger-changelog"), decode=False).values()
            for _, key, value in recs]


def parent_results(kafka_topics) -> dict[str, dict]:
    return {r["event_id"]: r for recs in read_partitions(kafka_topics.bootstrap_servers,
                                                         kafka_topics.name("settlement-results")).values()
            for _, _, r in recs if r["parent_id"] == PARENT}


def test_a_closed_parent_is_compacted_after_its_retention(kafka_topics, tmp_path: Path) -> None:
    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    codec = default_codec()
    clock = tmp_path / "clock"
    clock.write_text(str(T0))
    clock_args = ("--clock-file", str(clock), "--tick-interval-ms", "1")
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=clock_args)
    try:
        run = settle("produce", str(write_lines(tmp_path / "opening.jsonl", OPENING)), *common)
        assert run.returncode == 0, run.stdout + run.stderr
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, len(OPENING), 120, [proc])
        assert [r["result"] for r in parent_results(kafka_topics).values()] == ["ok"] * len(OPENING)
        child_key = keys.child_key(PARENT, "A")
        assert any(key == child_key and value is not None for key, value in changelog(kafka_topics))

        clock.write_text(str(T0 + model.CLOSED_PARENT_RETENTION_MS + 60_000))  # ledger time passes the retention
        deadline = time.monotonic() + 120
        while not any(key == child_key and value is None for key, value in changelog(kafka_topics)):
            assert time.monotonic() < deadline, "no tombstone of the child in the changelog"
            assert proc.proc.poll() is None, proc.output()[-3000:]
            time.sleep(1)
        records = changelog(kafka_topics)
        deleted = {key for key, value in records if value is None}
        idempotency = {key for key, _ in records if key.startswith(keys.idempotency_key(PARENT, ""))}
        assert len(idempotency) == len(OPENING) and idempotency <= deleted
        assert child_key in deleted
        [tombstone] = [codec.decode(value)[1] for key, value in records if key == keys.parent_key(PARENT)][-1:]
        assert tombstone["status"] == "closed" and tombstone["compacted_at_ms"] is not None
        assert tombstone["children"] == [] and tombstone["dimensions"] == {}

        run = settle("produce", str(write_lines(tmp_path / "late.jsonl", LATE)), *common)
        assert run.returncode == 0, run.stdout + run.stderr
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, len(OPENING) + len(LATE), 120, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    results = parent_results(kafka_topics)
    assert [results[e["event_id"]]["result"] for e in LATE] == ["parent_closed"] * len(LATE)
    assert "compacted" in results[LATE[0]["event_id"]]["detail"]
    releases = [r for recs in read_partitions(kafka_topics.bootstrap_servers,
                                              kafka_topics.name("capacity-releases")).values()
                for _, _, r in recs if r.get("parent_id") == PARENT]
    assert all(r["triggering_event_id"] in {e["event_id"] for e in OPENING} for r in releases)  # none late
    audits = [r for recs in read_partitions(kafka_topics.bootstrap_servers,
                                            kafka_topics.name("settlement-audit")).values()
              for _, _, r in recs if r["parent_id"] == PARENT and "compacted" in r["note"]]
    assert len(audits) == 1 and audits[0]["event_type"] == "Tick"

    live = projection_ledgers(tmp_path / "state", "g")
    # A processor with an empty state directory restores from the changelog, tombstones included.
    again = ProcessorProcess(kafka_topics, tmp_path / "restored", tmp_path / "restored.log", slot="b", group="g",
                             extra_args=clock_args)
    try:
        again.wait_started(120)
        deadline = time.monotonic() + 120
        while "restored" not in again.output() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)
    finally:
        assert again.stop() == 0, again.output()[-3000:]
    assert projection_ledgers(tmp_path / "restored", "g") == live

    run = settle("replay", "--topic", "branch-events", *common, "--state-dir", str(tmp_path / "state"),
                 "--group-id", "g")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "AGREES" in run.stdout
