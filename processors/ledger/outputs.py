"""What the fold emits, collected per checkpoint. Every record is a dict shaped like its Avro schema."""

from __future__ import annotations

from dataclasses import dataclass, field

# Output record lists of `Outputs`, the topic (logical name) each goes to, and its Avro record name: the one
# routing table, from which the processor's producer, the cross-check, the simulations and the benchmarks derive.
OUTPUT_ROUTES = (
    ("results", "settlement-results", "SettlementResult"),
    ("releases", "capacity-releases", "CapacityReleased"),
    ("settled", "capacity-releases", "ParentSettled"),
    ("revocations", "capacity-releases", "LoanRevocationRequested"),
    ("audits", "settlement-audit", "AuditRecord"),
)
DEAD_LETTER_TOPIC = "branch-events-dlq"
# Every topic a partition's outputs go to (logical names), in the order the routes name them.
OUTPUT_TOPICS = (*dict.fromkeys(topic for _, topic, _ in OUTPUT_ROUTES), DEAD_LETTER_TOPIC)


@dataclass
class Outputs:
    results: list[dict] = field(default_factory=list)
    releases: list[dict] = field(default_factory=list)
    audits: list[dict] = field(default_factory=list)
    settled: list[dict] = field(default_factory=list)
    revocations: list[dict] = field(default_factory=list)
    # When a list: a tick appends, before each timer it fires, (the timer, how many releases, audit records
    # and summaries there were), so a fold split by parent can put several shards' expiries back in the order
    # one fold gives them (processors/replay/sharded.py). None: not recorded.
    timer_marks: list | None = None

    def clear(self) -> None:
        self.results.clear()
        self.releases.clear()
        self.audits.clear()
        self.settled.clear()
        self.revocations.clear()

    def extend(self, other: "Outputs") -> None:
        self.results.extend(other.results)
        self.releases.extend(other.releases)
        self.audits.extend(other.audits)
        self.settled.extend(other.settled)
        self.revocations.extend(other.revocations)

    def count(self) -> int:
        return len(self.results) + len(self.releases) + len(self.audits) + len(self.settled) + len(self.revocations)
