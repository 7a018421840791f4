"""The deterministic simulation (faults/sim.py): the real processor code against a simulated log with
transactions, crashes at every commit step and in restores, broker errors, duplicates and reordering. A
failure names the seed: `python -m faults.sim --seed N` reproduces it."""

from __future__ import annotations

import pytest

from faults import sim

pytestmark = [pytest.mark.unit, pytest.mark.fault]

RUNS = 600


def test_many_seeded_runs_commit_exactly_what_a_fault_free_run_commits() -> None:
    outcome = sim.run_many(RUNS)
    faults = outcome["faults"]
    # The runs did meet every fault they are meant to meet.
    for fault in (*(f"crash_{p}" for p in sim.CRASH_POINTS), *sim.BROKER_FAULTS, "crash_between_folds",
                  "delete_projection", "redeliver"):
        assert faults.get(fault, 0) > 10, (fault, faults)
    assert outcome["incarnations"] > 2 * RUNS


def test_the_same_seed_gives_the_same_run() -> None:
    first, second = sim.run_seed(4242), sim.run_seed(4242)
    assert first["faults"] == second["faults"] and first["incarnations"] == second["incarnations"]


def test_a_broker_that_commits_offsets_without_the_records_is_caught(monkeypatch) -> None:
    """The simulation can fail for the right reason: break atomicity (the records of a transaction are
    lost when it commits, its offsets are not) and it names a seed."""
    original = sim.Broker.end_txn

    def lossy(self, commit: bool) -> None:
        if commit and self.open_txn is not None and self.epoch % 3 == 0:
            entries = self.open_txn["entries"]
            lost = next((e for e in reversed(entries) if e[0] in sim.OUTPUT_TOPICS), None)
            if lost is not None:
                entries.remove(lost)
                self.log(lost[0], lost[1]).entries[lost[2]][2] = "aborted"
        original(self, commit)

    monkeypatch.setattr(sim.Broker, "end_txn", lossy)
    with pytest.raises(AssertionError, match=r"seed \d+ \(reproduce: python -m faults.sim --seed \d+\)"):
        sim.run_many(200, first_seed=10_000)


def test_a_projection_written_before_the_commit_is_caught(monkeypatch) -> None:
    """The faust anti-pattern (decisions.md #1): write the store batch when the checkpoint is encoded, before
    the transaction commits. An abort then leaves state the log does not have, which the processor folds on
    from; the simulation reports the seed."""
    import branch_settlement.processors.kafka.checkpoint as checkpoint

    encode = checkpoint.encode_checkpoint

    def eager(tasks, topics):
        count, changes = encode(tasks, topics)
        for task in tasks:
            task.store.write(changes[task.partition], task.store.changelog_offset())
        return count, changes

    monkeypatch.setattr(checkpoint, "encode_checkpoint", eager)
    with pytest.raises(AssertionError, match=r"seed \d+ \(reproduce"):
        sim.run_many(200, first_seed=20_000)
