"""A JSON Lines file folded in parent shards (processors/replay/sharded.py) gives what one fold gives, byte for byte:
the document of `settle replay --json` and the summary of `settle replay`, whatever the number of shards, on
workloads whose ticks expire parents of several shards at once, and on lines whose bytes do not tell their
parent. Run in a fresh process: the shards are forked, and a fork of a threaded process may deadlock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from branch_settlement.processors.workload import Generator

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import io, json, sys
from branch_settlement.processors.replay import sharded
from branch_settlement.processors.replay.replayer import document, ledger_snapshot, read_events, replay, replay_document
from branch_settlement.processors.replay.report import print_summary
from branch_settlement.schemas.codec import default_codec
codec = default_codec()
path, jobs = sys.argv[1], [int(j) for j in sys.argv[2].split(",")]

def summary(result, ledger):
    out = io.StringIO()
    print_summary(result, ledger, out)
    return out.getvalue()

result, store = replay(read_events(path, codec), codec=codec)
want_doc = json.dumps(replay_document(result, store, codec), indent=2)
want_text = summary(result, ledger_snapshot(store, codec))
report = {"events": result.events, "releases": len(result.outputs.releases), "dead_letters": len(result.dead_letters)}
for n in jobs:
    got, ledger = sharded.replay_jsonl(path, codec, jobs=n, checkpoint_events=50)
    report[n] = {"document": json.dumps(document(got, ledger), indent=2) == want_doc,
                 "summary": summary(got, ledger) == want_text,
                 "shard_events": [sharded.fold_shard(path, codec, k, n).events for k in range(n)]}
print(json.dumps(report))
"""


def check(path: Path, jobs: str = "2,3") -> dict:
    done = subprocess.run([sys.executable, "-c", CHECK, str(path), jobs], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def event(kind: str, parent: str, key: str, **fields) -> dict:
    return {"type": kind, "event_id": f"e-{key}", "idempotency_key": key, "parent_id": parent, "occurred_at_ms": 1,
            **fields}


def tick(now_ms: int) -> dict:
    return event("Tick", "", f"tick/{now_ms}", now_ms=now_ms)


def expiring_parents(parents: int) -> list[dict]:
    """Parents of four children, some activated, all reserved before the first tick with the same lease:
    one later tick expires every parent and every activated child, in every shard at once."""
    items = [tick(1_000)]
    for n in range(parents):
        pid = f"P{n:03d}"
        items.append(event("ParentReserved", pid, f"{pid}/r", capacity={"tokens": {"quantity": 100, "kind": "logical"},
                                                                      "gpu": {"quantity": 4, "kind": "physical"}},
                           lease_ttl_ms=60_000, policy={"max_live_children": 8, "reconciliation_timeout_ms": 5_000,
                                                        "lending_limit": {}}))
        for c in range(4):
            items.append(event("ChildReserved", pid, f"{pid}/c{c}", child_id=f"c{c}", branch_id=f"b{c}",
                               attempt_id=f"a{c}", quantities={"tokens": 10, "gpu": 1}))
        items.append(event("ChildActivated", pid, f"{pid}/c0/act", child_id="c0", attempt_id="a0", lease_generation=1,
                           lease_ttl_ms=30_000))
    items += [tick(40_000), tick(61_000), tick(200_000)]  # child leases, parent leases, reconciliation timeouts
    return items


def write(path: Path, items: list) -> Path:
    path.write_text("\n".join(item if isinstance(item, str) else json.dumps(item) for item in items) + "\n")
    return path


def test_ticks_expiring_parents_of_every_shard_merge_in_one_folds_order(tmp_path: Path) -> None:
    report = check(write(tmp_path / "expiring.jsonl", expiring_parents(60)))
    assert report["releases"] > 200  # every parent's unassigned balance and never-activated children, to the pool
    for jobs in ("2", "3"):
        assert report[jobs]["document"] and report[jobs]["summary"], report
        shares = report[jobs]["shard_events"]
        assert all(0 < share < report["events"] for share in shares), shares


def test_a_workload_with_lines_whose_bytes_do_not_name_their_parent(tmp_path: Path) -> None:
    items: list = list(Generator(5).generate(8_000))
    awkward = [
        '{"type": "Tick", "event_id": "t-odd", "idempotency_key": "tick/odd", "parent_id": "", "occurred_at_ms": 1, '
        '"now_ms": 5}',  # a stale tick, decoded by every shard
        json.dumps(event("ParentReserved", "p\\u0041", "esc/r", capacity={"tokens": {"quantity": 5, "kind": "logical"}},
                         lease_ttl_ms=10, policy={"max_live_children": 1, "reconciliation_timeout_ms": 1,
                                                  "lending_limit": {}})).replace("\\\\u0041", "\\u0041"),
        json.dumps(event("ParentClosed", "dup", "dup/close", outcome="failed"))[:-1] + ', "parent_id": "other"}',
        json.dumps({**event("ParentClosed", "X", "x/close", outcome="failed"), "extra": {"parent_id": "Y"}}),
        json.dumps(event("ChildSkipped", "", "empty/skip", child_id="c", attempt_id="a", reason="r")),
        json.dumps(event("Tick", "P7", "tick/P7", now_ms=10**12)),  # a tick naming a parent: invalid, its shard's
        "not json at all", '{"parent_id": "P1", "broken": ', "[1, 2]", "",
    ]
    for n, line in enumerate(awkward):
        items.insert(500 + 700 * n, line)
    report = check(write(tmp_path / "awkward.jsonl", items))
    assert report["dead_letters"] >= 5
    for jobs in ("2", "3"):
        assert report[jobs]["document"] and report[jobs]["summary"], report
