"""What the fold emits, collected per checkpoint. Every record is a dict shaped like its Avro schema."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outputs:
    results: list[dict] = field(default_factory=list)
    releases: list[dict] = field(default_factory=list)
    audits: list[dict] = field(default_factory=list)
    settled: list[dict] = field(default_factory=list)
    # When a list: a tick appends, before each timer it fires, (the timer, how many releases, audit records
    # and summaries there were), so a fold split by parent can put several shards' expiries back in the order
    # one fold gives them (processors/replay/sharded.py). None: not recorded.
    timer_marks: list | None = None

    def clear(self) -> None:
        self.results.clear()
        self.releases.clear()
        self.audits.clear()
        self.settled.clear()

    def extend(self, other: "Outputs") -> None:
        self.results.extend(other.results)
        self.releases.extend(other.releases)
        self.audits.extend(other.audits)
        self.settled.extend(other.settled)

    def count(self) -> int:
        return len(self.results) + len(self.releases) + len(self.audits) + len(self.settled)
