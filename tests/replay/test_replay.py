"""`settle replay`: the worked example of SPEC §13, determinism, bad input, Avro container files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from branch_settlement.processors.cli.main import main
from branch_settlement.processors.replay.replayer import read_events, replay, replay_document
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas.codec import default_codec

pytestmark = pytest.mark.unit

CLOSE = {"type": "ParentClosed", "event_id": "we-15", "idempotency_key": "wf-42/ParentClosed/1",
         "parent_id": "wf-42", "occurred_at_ms": 1764410400150, "outcome": "succeeded"}


def run_json(path: Path, capsys, *extra: str) -> dict:
    assert main(["replay", "--json", str(path), *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_worked_example_gives_the_expected_outcome(worked_example: Path, capsys) -> None:
    doc = run_json(worked_example, capsys)
    tokens = doc["parents"]["wf-42"]["dimensions"]["tokens"]
    assert doc["parents"]["wf-42"]["status"] == "open"
    assert tokens == {"capacity": 100, "available": 63, "outstanding": 0, "pending": 0, "awaiting_confirmation": 0,
                      "lent": 0, "returned_to_pool": 0, "committed": 37, "overdrawn": 0}
    children = doc["children"]
    assert {k: (c["state"], c["consumed"]["tokens"]) for k, c in children.items()} == {
        "wf-42/A": ("committed", 20), "wf-42/B": ("released", 12), "wf-42/C": ("released", 0),
        "wf-42/D": ("released", 5)}
    assert [(r["child_id"], r["quantity"], r["destination"]) for r in doc["releases"]] == [
        ("B", 8, "parent"), ("C", 20, "parent"), ("D", 15, "parent")]
    results = {r["event_id"]: r["result"] for r in doc["results"]}
    assert results.pop("we-dup") == "duplicate"
    assert set(results.values()) == {"ok"} and len(results) == 14
    assert doc["dead_letters"] == []


def test_worked_example_passes_through_expired_and_reconciling(worked_example: Path) -> None:
    codec = default_codec()
    result, _ = replay(read_events(worked_example, codec), codec=codec)
    d_states = [(a["prior_state"], a["new_state"]) for a in result.outputs.audits
                if a["child_id"] == "D" and a["prior_state"] != a["new_state"]]
    assert d_states == [("", "reserved"), ("reserved", "activated"), ("activated", "expired"),
                        ("expired", "reconciling"),
                        ("reconciling", "released")]


def test_closing_the_worked_example_sends_63_to_the_pool(worked_example: Path, tmp_path: Path, capsys) -> None:
    closed = tmp_path / "closed.jsonl"
    closed.write_text(worked_example.read_text() + json.dumps(CLOSE) + "\n")
    doc = run_json(closed, capsys)
    assert doc["parents"]["wf-42"]["status"] == "closed"
    assert doc["parents"]["wf-42"]["dimensions"]["tokens"]["returned_to_pool"] == 63
    assert doc["releases"][-1] == {"parent_id": "wf-42", "child_id": "", "dimension": "tokens", "quantity": 63,
                                   "destination": "global_pool", "reason": "parent_closed"}


def test_replay_is_byte_identical_across_runs_and_stores(worked_example: Path, tmp_path: Path) -> None:
    def cli(*args: str) -> bytes:
        return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", "replay", "--json", *args],
                              check=True, capture_output=True).stdout

    first = cli(str(worked_example))
    assert cli(str(worked_example)) == first
    assert cli(str(worked_example), "--store", str(tmp_path / "db"), "--checkpoint-events", "3") == first


def test_bad_lines_become_dead_letters_and_the_replay_goes_on(worked_example: Path, tmp_path: Path, capsys) -> None:
    lines = worked_example.read_text().splitlines()
    bad = lines[:3] + ["{not json", "[1, 2]", '{"type": "Nope", "event_id": "x"}',
                       '{"type": "Tick", "event_id": "t", "idempotency_key": "k", "parent_id": "", '
                       '"occurred_at_ms": 1, "now_ms": "soon"}'] + lines[3:]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(bad) + "\n")
    doc = run_json(path, capsys)
    assert [d["line"] for d in doc["dead_letters"]] == [4, 5, 6, 7]
    assert "not valid JSON" in doc["dead_letters"][0]["reason"]
    assert "Tick.now_ms" in doc["dead_letters"][3]["reason"]
    assert doc["parents"]["wf-42"]["dimensions"]["tokens"]["available"] == 63  # the good lines all applied


def test_invalid_event_gets_a_result_not_a_dead_letter(tmp_path: Path, capsys) -> None:
    path = tmp_path / "neg.jsonl"
    path.write_text(json.dumps({"type": "ChildReserved", "event_id": "e1", "idempotency_key": "k",
                                "parent_id": "p", "occurred_at_ms": 0, "child_id": "c", "branch_id": "b",
                                "attempt_id": "a", "quantities": {"tokens": -5}}) + "\n")
    doc = run_json(path, capsys)
    assert doc["results"] == [{"event_id": "e1", "result": "invalid_event"}]
    assert doc["dead_letters"] == []


def test_avro_container_replays_like_json_lines(worked_example: Path, tmp_path: Path, capsys) -> None:
    codec = default_codec()
    events = [item.event for item in read_events(worked_example, codec)]
    avro = tmp_path / "events.avro"
    codec.write_container(avro, events)
    assert run_json(avro, capsys) == run_json(worked_example, capsys)


def test_rocksdb_replay_keeps_the_ledger(worked_example: Path, tmp_path: Path) -> None:
    codec = default_codec()
    store = RocksStore(tmp_path / "db")
    result, store = replay(read_events(worked_example, codec), store, codec=codec, checkpoint_events=4)
    doc = replay_document(result, store, codec)
    store.close()
    reopened = RocksStore(tmp_path / "db", read_only=True)
    assert reopened.changelog_offset() == 14
    from branch_settlement.processors.replay.replayer import ledger_snapshot
    assert ledger_snapshot(reopened, codec)["parents"] == doc["parents"]
    reopened.close()


def test_replay_reads_standard_input_as_a_file(worked_example: Path) -> None:
    command = [sys.executable, "-m", "branch_settlement.processors.cli.main", "replay", "--json"]
    from_file = subprocess.run([*command, str(worked_example)], capture_output=True, text=True)
    with open(worked_example, "rb") as stdin:
        from_stdin = subprocess.run([*command, "-"], stdin=stdin, capture_output=True, text=True)
    assert from_file.returncode == from_stdin.returncode == 0, from_stdin.stderr
    assert from_stdin.stdout == from_file.stdout and '"result": "ok"' in from_stdin.stdout


def test_cli_errors_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", "replay", str(tmp_path / "missing.jsonl")],
                          capture_output=True, text=True)
    assert proc.returncode == 2  # an error, not a divergence (1)
    assert proc.stderr.strip() == f"settle replay: no such file: {tmp_path / 'missing.jsonl'}"


def test_human_summary_shows_balances_and_releases(worked_example: Path, capsys) -> None:
    assert main(["replay", str(worked_example)]) == 0
    out = capsys.readouterr().out
    assert "15 events folded: 14 ok, 1 duplicate; 0 dead letters" in out
    assert "wf-42/D  tokens 15 -> parent (final_usage)" in out
