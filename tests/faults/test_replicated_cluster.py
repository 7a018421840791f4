"""The fault suite on a replicated cluster of its own (faults/cluster.py: three KRaft controllers and three
brokers on 127.0.0.1, replication factor 3, min.insync.replicas 2, the internal topics alike), reduced: one
scenario, the transaction coordinator's broker killed twice under load, through the same code as
`make faults` (which also runs leader_kill, controller_kill, rolling_restart and rebalance_kill, several
seeds each). The verifier must find what it finds on the shared broker (nothing lost, nothing twice, no open
transaction, every release within what was held, every tick once) and what a replicated cluster adds: the
layout read back from the cluster (R1) and every record a read_committed reader saw committed still there,
unchanged, after the failovers (R2).

The cluster is this module's: started by the fixture, stopped in its finally even when the test fails, on
free ports (never the shared broker's)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults.cluster import BROKER_IDS, ReplicatedCluster, java_hash, txn_state_partition
from faults.replicated import compare_seen
from faults.run import run_scenario
from tests.faults.test_fault_scenarios import INJECTED, SIZE, assert_exactly_once

pytestmark = [pytest.mark.fault, pytest.mark.kafka]

INJECTED.update({"coordinator_kill": {"txn_coordinator_kill_9"}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = ReplicatedCluster(tmp_path_factory.mktemp("replicated") / "cluster")
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.ensure_stopped()
        assert all(cluster.pid(n) is None for n in (1, 2, 3, *BROKER_IDS))


class _Shared:
    """run_scenario's SharedCluster interface over the fixture's cluster."""

    def __init__(self, cluster: ReplicatedCluster) -> None:
        self.cluster = cluster

    def get(self) -> ReplicatedCluster:
        self.cluster.up()
        return self.cluster


@pytest.mark.unit
def test_the_coordinator_partition_is_javas_hash() -> None:
    # Java: "abc".hashCode() == 96354, "".hashCode() == 0, "polygenelubricants".hashCode() == Integer.MIN_VALUE.
    assert java_hash("abc") == 96354 and java_hash("") == 0
    assert java_hash("polygenelubricants") == -(1 << 31)
    assert txn_state_partition("polygenelubricants") == 0
    assert txn_state_partition("abc") == 96354 % 8


@pytest.mark.unit
def test_r2_finds_a_record_gone_or_changed_after_a_failover() -> None:
    seen = {("r", 0): [(0, b"a"), (1, b"b")], ("r", 1): [(0, b"c")]}
    assert compare_seen(seen, {("r", 0): {0: b"a", 1: b"b", 2: b"x"}, ("r", 1): {0: b"c"}})["ok"]
    truncated = compare_seen(seen, {("r", 0): {0: b"a"}, ("r", 1): {0: b"c"}})
    assert not truncated["ok"] and truncated["missing"] == 1 and truncated["examples"] == ["r[0]@1 gone"]
    rewritten = compare_seen(seen, {("r", 0): {0: b"a", 1: b"B"}, ("r", 1): {}})
    assert not rewritten["ok"] and (rewritten["mismatches"], rewritten["missing"]) == (1, 1)
    assert not compare_seen({}, {})["ok"]  # a reader that saw nothing proves nothing


@pytest.mark.unit
def test_the_reaper_kills_the_nodes_of_a_suite_that_died(tmp_path: Path) -> None:
    """A suite killed with SIGKILL runs no `finally`: faults/reaper.py kills its nodes (and nothing else)."""
    node_dir, other_dir = tmp_path / "broker-4", tmp_path.parent / f"{tmp_path.name}-other" / "broker-5"
    nodes = []
    for d in (node_dir, other_dir):
        d.mkdir(parents=True)
        fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "kafka.Kafka",
                                 str(d / "server.properties")])
        (d / "pid").write_text(str(fake.pid))
        nodes.append(fake)
    suite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    reaper = subprocess.Popen([sys.executable, "-m", "faults.reaper", str(suite.pid), str(tmp_path)],
                              cwd=Path(__file__).resolve().parents[2])
    try:
        time.sleep(1.5)
        assert reaper.poll() is None and nodes[0].poll() is None  # the suite lives: nothing is touched
        suite.kill()
        suite.wait(10)
        assert reaper.wait(20) == 0
        assert nodes[0].wait(10) == -9
        assert nodes[1].poll() is None  # another run directory's node is not its business
    finally:
        for p in (*nodes, suite, reaper):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_transaction_coordinator_killed_under_load(cluster: ReplicatedCluster, tmp_path: Path) -> None:
    report = run_scenario("coordinator_kill", 130, SIZE, (), tmp_path, stall_s=120, cluster=_Shared(cluster))
    assert_exactly_once(report, "coordinator_kill")
    assert report["faults"]["txn_coordinator_kill_9"] == 2
    assert {"R1", "R2"} <= set(report["invariants"])
    # A failover is no hanging transaction: the stability watch must not cry wolf (docs/faults.md, finding 5).
    assert report["critical_log_lines"] == 0
    layout, survived = report["invariants"]["R1"], report["invariants"]["R2"]
    assert layout["internal_topics"] == ["__consumer_offsets", "__transaction_state"] and layout["isr_whole_at_end"]
    # Records were committed before each kill, and every one of them survived it.
    seen = survived["seen_committed_at_each_fault"]
    assert len(seen) == 2 and 0 < seen[0] < seen[1] <= survived["records_checked"]
    assert survived["missing"] == survived["mismatches"] == 0
    # Each kill landed while the processor had input left to fold, and hit the coordinator it asked for.
    kills = report["cluster"]["faults"]
    assert [k["fault"] for k in kills] == ["txn_coordinator_kill_9"] * 2
    assert all(k["at_fraction"] < 0.95 for k in kills), kills
    assert all("coordinator of" in k["why"] for k in kills)
    # A coordinator's broker also leads partitions: the kills failed over some of the scenario's leaders.
    assert sum(k["led_partitions_of_the_scenario"] for k in kills) > 0, kills
