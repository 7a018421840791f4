"""What a cross-check finds: each divergence (topic, partition, offset, what was expected and found), each
partition's outcome as the process that replayed it sends it back, and the report of the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field

from branch_settlement.processors.replay.replayer import ReplayResult
from branch_settlement.projections.store import Store


@dataclass
class Divergence:
    topic: str
    partition: int
    offset: int | None  # of the published record; None when it is missing
    input_offset: int | None
    problem: str  # missing | extra | different | ledger | not yet processed (see NOT_YET_PROCESSED)
    expected: object = None
    found: object = None

    def describe(self) -> str:
        where = f"{self.topic}[{self.partition}]" + (f"@{self.offset}" if self.offset is not None else "")
        cause = f" (input offset {self.input_offset})" if self.input_offset is not None else ""
        return f"{self.problem:<9} {where}{cause}\n    expected: {self.expected}\n    found:    {self.found}"

    def as_json(self) -> dict:
        return {"problem": self.problem, "topic": self.topic, "partition": self.partition, "offset": self.offset,
                "input_offset": self.input_offset, "expected": self.expected, "found": self.found}


# An output the re-fold expects for an input the processors' group has not committed yet (at or beyond its
# committed offset): the processor's lag, not a divergence.
NOT_YET_PROCESSED = "not yet processed"


@dataclass
class Lag:
    """One partition of the input as the processors' group had committed it when the replay began."""

    committed: int  # the group's committed offset: the next input it folds (0 when it committed nothing)
    input_end: int  # where the replay's snapshot of the input ends

    @property
    def inputs(self) -> int:
        """Input records of the snapshot the group has not committed yet."""
        return max(0, self.input_end - self.committed)


@dataclass
class Report:
    events: int = 0
    partitions: list[int] = field(default_factory=list)
    compared: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    folded: dict = field(default_factory=dict)
    seconds: float = 0.0
    processes: dict = field(default_factory=dict)  # partition -> (pid, its CPU seconds, wall time) when done
    # Outputs expected for inputs the processors' group had not committed (not divergences), and its lag.
    not_yet_processed: list[Divergence] = field(default_factory=list)
    group_id: str | None = None
    lag: dict[int, Lag] = field(default_factory=dict)

    @property
    def agrees(self) -> bool:
        """Everything the processors committed matches the replay: outputs not yet processed do not count."""
        return not self.divergences

    @property
    def inputs_not_yet_processed(self) -> int:
        return sum(lag.inputs for lag in self.lag.values())

    def as_json(self) -> dict:
        """The cross-check as JSON (no timings: the same topics give the same bytes)."""
        return {"agrees": self.agrees, "events": self.events, "partitions": self.partitions,
                "compared": self.compared, "divergences": [d.as_json() for d in self.divergences],
                "not_yet_processed": {
                    "group_id": self.group_id, "inputs": self.inputs_not_yet_processed,
                    "outputs": len(self.not_yet_processed),
                    "partitions": {str(p): {"committed": lag.committed, "input_end": lag.input_end,
                                            "inputs": lag.inputs} for p, lag in sorted(self.lag.items())},
                    "expected": [d.as_json() for d in self.not_yet_processed]}}


@dataclass
class PartitionOutcome:
    """One partition's replay and comparison."""

    events: int = 0
    compared: int = 0
    divergences: dict[str, list[Divergence]] = field(default_factory=dict)  # section -> divergences
    not_yet_processed: list[Divergence] = field(default_factory=list)
    folded: tuple[ReplayResult, Store] | None = None
    process: int = 0  # pid of the process that replayed it
    cpu_s: float = 0.0  # that process's CPU time when it was done
    done_at: float = 0.0  # wall-clock time when it was done


__all__ = ["Divergence", "NOT_YET_PROCESSED", "Lag", "Report", "PartitionOutcome"]
