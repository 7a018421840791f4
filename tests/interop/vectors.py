"""Shared test vectors of the wire formats: one record of every type that other programs read or write
(schemas/confluent.py EXTERNAL_TYPES: the events and the outputs), as the project's codecs write it.

Each line of `vectors.jsonl` holds the record's name, its registered schema (self-contained, with docs and
defaults), the schema id it has in the vectors' registry snapshot (ids 1, 2, ... in name order), the record in
Avro's JSON encoding (written by fastavro), its single-object encoding and its Confluent frame, both in hex.
Another language's Avro library checks them (tests/interop/java/CheckVectors.java, run by
tests/interop/test_java_interop.py): it decodes both encodings and the JSON to the same record, and encodes
that record back to the same bytes. `tests/interop/test_vectors.py` checks that the committed file is what the
codecs write today, so it cannot go stale.

    python -m tests.interop.vectors            # rewrite tests/interop/vectors.jsonl
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import fastavro

from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.confluent import EXTERNAL_TYPES, ConfluentCodec, StaticSchemas, standalone_schemas
from tests.harness import T0, Ledger

VECTORS = Path(__file__).resolve().parent / "vectors.jsonl"


def snapshot_registry() -> StaticSchemas:
    """The vectors' registry: every external record's schema under id 1, 2, ... in name order."""
    schemas = standalone_schemas()
    return StaticSchemas({i: schemas[name] for i, name in enumerate(sorted(EXTERNAL_TYPES), start=1)})


def scenario_records() -> dict[str, dict]:
    """The first record of every external type from a scenario that uses the whole vocabulary: events as
    sent, outputs as the fold derived them, and one dead letter."""
    L = Ledger()
    events: list[dict] = []

    def send(etype: str, key: str | None = None, **fields) -> None:
        event = L.event(etype, key, **fields)
        events.append(event)
        L.apply(event)

    capacity = {"tokens": {"quantity": 100, "kind": "logical"}, "gpus": {"quantity": 4, "kind": "physical"}}
    L.tick(T0)
    send("ParentReserved", capacity=capacity, lease_ttl_ms=3_600_000,
         policy={"max_live_children": 8, "reconciliation_timeout_ms": 600_000, "lending_limit": {"tokens": 40}})
    send("LoanRequested", key="P/loan/L1/request", loan_id="L1", borrower="batch-jobs", quantities={"tokens": 30})
    send("ChildReserved", child_id="E", branch_id="e", attempt_id="E1", quantities={"tokens": 80})  # revokes L1
    send("LoanReturned", key="P/loan/L1/return", loan_id="L1", usage={"tokens": 5})
    send("ChildReserved", child_id="A", branch_id="a", attempt_id="A1", quantities={"tokens": 20, "gpus": 2})
    send("ChildActivated", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=60_000)
    send("LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=60_000)
    send("UsageReported", child_id="A", attempt_id="A1", lease_generation=1, usage_report_id="u1",
         usage={"tokens": 4}, final=False)
    send("ChildCompleted", child_id="A", attempt_id="A1", lease_generation=1, usage={"tokens": 12, "gpus": 0})
    send("SchedulerReleaseConfirmed", child_id="A", attempt_id="A1", dimension="gpus")
    send("UsageAdjustment", child_id="A", attempt_id="A1", usage={"tokens": 1}, reason="late meter")
    send("ChildReserved", child_id="B", branch_id="b", attempt_id="B1", quantities={"tokens": 10})
    send("ReservationTransferred", child_id="B", from_attempt_id="B1", to_attempt_id="B2")
    send("ChildSkipped", child_id="B", attempt_id="B2", reason="not needed")
    send("ChildReserved", child_id="C", branch_id="c", attempt_id="C1", quantities={"tokens": 10})
    send("ChildReserved", child_id="D", branch_id="c", attempt_id="D1", quantities={"tokens": 10})
    send("ChildActivated", child_id="C", attempt_id="C1", lease_generation=1, lease_ttl_ms=60_000)
    send("ChildActivated", child_id="D", attempt_id="D1", lease_generation=1, lease_ttl_ms=60_000)
    send("SpeculativeWinner", branch_id="c", winner_attempt_id="C1")
    send("CancelRequested", child_id="D", attempt_id="D1", reason="lost the race")
    send("CancelAcknowledged", child_id="D", attempt_id="D1", lease_generation=1, usage={"tokens": 3})
    send("ChildFailed", child_id="C", attempt_id="C1", lease_generation=1, activated=True, usage_uncertain=True,
         reason="worker lost")
    send("ReconciliationResolved", child_id="C", attempt_id="C1", usage={"tokens": 6}, resolution="late_report")
    send("ParentClosed", outcome="succeeded")
    records = {}
    for event in events:
        records.setdefault(event["type"], event)
    for name, attr in (("SettlementResult", "results"), ("CapacityReleased", "releases"),
                       ("ParentSettled", "settled"), ("AuditRecord", "audits"),
                       ("LoanRevocationRequested", "revocations")):
        items = getattr(L.out, attr)
        if items:
            records.setdefault(name, items[0])
    records["DeadLetter"] = {"source_topic": "branch-events", "partition": 3, "offset": 42,
                             "original": b"\xc3\x01not avro", "reason": "bad single-object body", "line": None,
                             "event_id": None}
    return records


def avro_json(schema_text: str, record: dict) -> str:
    """The record in Avro's JSON encoding (unions as {"type": value}, bytes as ISO-8859-1 strings)."""
    out = io.StringIO()
    fastavro.json_writer(out, fastavro.parse_schema(json.loads(schema_text)), [_without_type(record)])
    return out.getvalue().strip()


def _without_type(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "type"}


def build() -> list[dict]:
    registry = snapshot_registry()
    confluent = ConfluentCodec(registry)
    registered = {r.name: r.schema_id for r in confluent.check_and_register()}
    single = default_codec()
    records = scenario_records()
    missing = sorted(set(EXTERNAL_TYPES) - set(records))
    if missing:
        raise SystemExit(f"the vectors' scenario has no record of {', '.join(missing)}: extend scenario_records")
    schemas = standalone_schemas()
    vectors = []
    for name in sorted(EXTERNAL_TYPES):
        record = _without_type(records[name])
        vectors.append({
            "name": name, "fullname": single.version(name).fullname, "schema_id": registered[name],
            "schema": schemas[name], "avro_json": avro_json(schemas[name], record),
            "single_object": single.encode(name, record).hex(), "confluent": confluent.encode(name, record).hex(),
        })
    return vectors


def render(vectors: list[dict]) -> str:
    return "".join(json.dumps(v, sort_keys=True) + "\n" for v in vectors)


def main() -> int:
    VECTORS.write_text(render(build()))
    print(f"wrote {VECTORS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
