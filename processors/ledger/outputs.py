"""What the fold emits, collected per checkpoint. Every record is a dict shaped like its Avro schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from branch_settlement.schemas import native
from branch_settlement.schemas.codec import Codec

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


def output_encoder(codec: Codec) -> Callable[[Outputs, list, dict], None]:
    """`encode(out, records, released)`, as the processor buffers a folded event's outputs: each of `out`'s
    records, route by route, appended to `records` as (topic, the parent id's UTF-8, the record encoded by `codec`);
    each release's quantity added to `released` under (dimension, destination); then `out` cleared. Compiled
    (native/src/outputs.rs) when the codec is, with the same bytes."""
    writers = codec.plain_encoders()
    # Compiled only where `encode` is the codec's own: a ConfluentCodec frames its external records otherwise.
    if codec.implementation == native.COMPILED and type(codec).encode is Codec.encode and all(
            isinstance(writers[name], native.module().Encoder) for _, _, name in OUTPUT_ROUTES):
        return native.module().OutputEncoder([(attr, topic, name, writers[name]) for attr, topic, name in OUTPUT_ROUTES],
                                             codec.encode)
    encode = codec.encode

    def encode_outputs(out: Outputs, records: list, released: dict) -> None:
        for attr, topic, record_name in OUTPUT_ROUTES:
            for record in getattr(out, attr):
                records.append((topic, record["parent_id"].encode(), encode(record_name, record)))
        for release in out.releases:
            key = (release["dimension"], release["destination"])
            released[key] = released.get(key, 0) + release["quantity"]
        out.clear()

    return encode_outputs
