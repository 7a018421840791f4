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
    problem: str  # missing | extra | different | ledger
    expected: object = None
    found: object = None

    def describe(self) -> str:
        where = f"{self.topic}[{self.partition}]" + (f"@{self.offset}" if self.offset is not None else "")
        cause = f" (input offset {self.input_offset})" if self.input_offset is not None else ""
        return f"{self.problem:<9} {where}{cause}\n    expected: {self.expected}\n    found:    {self.found}"


@dataclass
class Report:
    events: int = 0
    partitions: list[int] = field(default_factory=list)
    compared: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    folded: dict = field(default_factory=dict)
    seconds: float = 0.0
    processes: dict = field(default_factory=dict)  # partition -> (pid, its CPU seconds, wall time) when done

    @property
    def agrees(self) -> bool:
        return not self.divergences


@dataclass
class PartitionOutcome:
    """One partition's replay and comparison."""

    events: int = 0
    compared: int = 0
    divergences: dict[str, list[Divergence]] = field(default_factory=dict)  # section -> divergences
    folded: tuple[ReplayResult, Store] | None = None
    process: int = 0  # pid of the process that replayed it
    cpu_s: float = 0.0  # that process's CPU time when it was done
    done_at: float = 0.0  # wall-clock time when it was done


__all__ = ["Divergence", "Report", "PartitionOutcome"]
