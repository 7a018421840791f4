"""Fuzzing the decoder and the fold: any bytes on the input topic, and any JSON line, end as a dead letter or as
one result, never as an exception, and the ledger auditor holds after every event.

The corpus is kept in the repository (tests/ledger/fuzz_corpus/: one Avro record in hex, or one JSON line, per
line): every event type in the states that matter, and the hostile records the input limits answer. Hypothesis
mutates its entries (byte flips, insertions, deletions, truncations, splices) and feeds each to a ledger that
already holds a parent with children live, reserved and in reconciliation. A mutation that finds a failure is
worth adding to the corpus: `python -m tests.ledger.test_fuzz` writes the corpus anew from `corpus_events()`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from branch_settlement.processors.ledger import results
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.replay.replayer import decode_json_line
from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.errors import CodecError
from branch_settlement.schemas.limits import MAX_ID_BYTES, MAX_QUANTITY
from tests.ledger.exhaustive import audited_fold, ledger_state

pytestmark = pytest.mark.unit

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
CODEC = default_codec()
T0 = 1_000_000
POLICY = {"max_live_children": 4, "reconciliation_timeout_ms": 100_000, "lending_limit": {"tokens": 30, "gpus": 1}}


def _event(etype: str, key: str, parent_id: str = "P", **fields) -> dict:
    return {"type": etype, "event_id": key, "idempotency_key": key, "parent_id": parent_id, "occurred_at_ms": 0,
            **fields}


def prefix_events() -> list[dict]:
    """The ledger every fuzz input meets: A activated, B reserved, C in reconciliation, physical GPUs, a loan L1
    of 10 tokens out (the parent lends up to 30 tokens and 1 GPU)."""
    return [
        _event("Tick", "tick/1", parent_id="", now_ms=T0),
        _event("ParentReserved", "P/p", capacity={"tokens": {"quantity": 100, "kind": "logical"},
                                                  "gpus": {"quantity": 4, "kind": "physical"}},
               lease_ttl_ms=10_000_000, policy=POLICY),
        _event("ChildReserved", "P/A", child_id="A", branch_id="b", attempt_id="A1",
               quantities={"tokens": 20, "gpus": 1}),
        _event("ChildActivated", "P/A/a", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=1_000_000),
        _event("ChildReserved", "P/B", child_id="B", branch_id="b", attempt_id="B1", quantities={"tokens": 10}),
        _event("ChildReserved", "P/C", child_id="C", branch_id="c", attempt_id="C1", quantities={"tokens": 10}),
        _event("ChildActivated", "P/C/a", child_id="C", attempt_id="C1", lease_generation=1, lease_ttl_ms=10),
        _event("Tick", "tick/2", parent_id="", now_ms=T0 + 20),
        _event("LoanRequested", "P/loan/L1/request", loan_id="L1", borrower="w", quantities={"tokens": 10}),
    ]


def corpus_events() -> list[dict]:
    """The corpus's events (JSON form): every type aimed at the prefix's children, and hostile values."""
    usage = {"tokens": 3, "gpus": 1}
    return [
        _event("ChildReserved", "P/D", child_id="D", branch_id="b", attempt_id="D1", quantities={"tokens": 5}),
        _event("ChildActivated", "P/B/a", child_id="B", attempt_id="B1", lease_generation=1, lease_ttl_ms=1000),
        _event("LeaseRenewed", "P/A/r", child_id="A", attempt_id="A1", lease_generation=2, lease_ttl_ms=1000),
        _event("UsageReported", "P/A/u", child_id="A", attempt_id="A1", lease_generation=1, usage_report_id="u1",
               usage=usage, final=False),
        _event("ChildCompleted", "P/A/c", child_id="A", attempt_id="A1", lease_generation=1, usage=usage),
        _event("ChildSkipped", "P/B/s", child_id="B", attempt_id="B1", reason="not needed"),
        _event("CancelRequested", "P/A/x", child_id="A", attempt_id="A1", reason="user"),
        _event("CancelAcknowledged", "P/A/k", child_id="A", attempt_id="A1", lease_generation=1, usage=usage,
               usage_uncertain=False, retry_attempt_id="A2"),
        _event("ChildFailed", "P/C/f", child_id="C", attempt_id="C1", lease_generation=1, activated=True,
               usage={"tokens": 2}, usage_uncertain=False, reason="boom", retry_attempt_id="C2"),
        _event("SpeculativeWinner", "P/b/w", branch_id="b", winner_attempt_id="A1"),
        _event("ReservationTransferred", "P/B/t", child_id="B", from_attempt_id="B1", to_attempt_id="B2"),
        _event("ReconciliationResolved", "P/C/r", child_id="C", attempt_id="C1", usage={"tokens": 4},
               resolution="operator"),
        _event("UsageAdjustment", "P/A/j", child_id="A", attempt_id="A1", usage={"tokens": MAX_QUANTITY},
               reason="invoice"),
        _event("SchedulerReleaseConfirmed", "P/A/g", child_id="A", attempt_id="A1", dimension="gpus"),
        _event("ParentClosed", "P/close", outcome="failed"),
        _event("Tick", "tick/3", parent_id="", now_ms=T0 + 10_000_000),
        _event("ChildReserved", "P/E", child_id="E" * (MAX_ID_BYTES + 1), branch_id="e", attempt_id="E1",
               quantities={"tokens": MAX_QUANTITY + 1}),
        _event("LoanRequested", "P/loan/L2/request", loan_id="L2", borrower="w2", quantities={"tokens": 5, "gpus": 1}),
        _event("LoanReturned", "P/loan/L1/return", loan_id="L1", usage={"tokens": 4}),
        _event("LoanReturned", "P/loan/L1/return", loan_id="L1", usage={"tokens": 60, "gpus": 1}),
        _event("ChildReserved", "P/F", child_id="F", branch_id="f", attempt_id="F1", quantities={"tokens": 55}),
        _event("LoanRequested", "P/loan/L3/request", loan_id="L3", borrower="w" * (MAX_ID_BYTES + 1),
               quantities={"tokens": MAX_QUANTITY + 1}),
    ]


def write_corpus() -> None:
    CORPUS.mkdir(exist_ok=True)
    events = [CODEC.event_from_json(e) for e in corpus_events()]
    (CORPUS / "avro.txt").write_text("".join(CODEC.encode_event(e).hex() + "\n" for e in events))
    (CORPUS / "jsonl.txt").write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in corpus_events()))


def _corpus(name: str) -> list[str]:
    """The corpus's lines ([] before it is written: the test of the corpus itself then fails)."""
    path = CORPUS / name
    return [line for line in path.read_text().splitlines() if line] if path.exists() else []


def _prefix_state() -> tuple:
    store, fold = audited_fold((), None)
    out = Outputs()
    for offset, event in enumerate(prefix_events()):
        assert fold.apply(CODEC.event_from_json(event), offset, out)["result"] == "ok", event
    store.write(fold.view.changes(), 0)
    return ledger_state(store), fold.auditor.snapshot()


_PREFIX = _prefix_state()


def fold_one(event: dict) -> str:
    """Fold `event` into a fresh copy of the prefix's ledger, with the auditor; return its result code."""
    _, fold = audited_fold(*_PREFIX)
    code = fold.apply(event, len(prefix_events()), Outputs())["result"]
    assert code in results.ALL, code
    return code


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: 0 flip a byte, 1 insert one, 2 delete one, 3 truncate."""
    buf = bytearray(data)
    for kind, position, value in edits:
        if not buf:
            break
        at = position % len(buf)
        if kind == 0:
            buf[at] ^= value or 1
        elif kind == 1:
            buf.insert(at, value)
        elif kind == 2:
            del buf[at]
        else:
            del buf[at:]
    return bytes(buf)


EDITS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10_000), st.integers(0, 255)), max_size=6)


def test_the_corpus_is_the_one_its_generator_writes() -> None:
    events = [CODEC.event_from_json(e) for e in corpus_events()]
    assert _corpus("avro.txt") == [CODEC.encode_event(e).hex() for e in events]
    assert _corpus("jsonl.txt") == [json.dumps(e, sort_keys=True) for e in corpus_events()]


@pytest.mark.parametrize("line", _corpus("avro.txt"))
def test_every_corpus_record_is_folded_with_a_result(line: str) -> None:
    fold_one(CODEC.decode_event(bytes.fromhex(line)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(line=st.sampled_from(_corpus("avro.txt") or ["00"]), other=st.sampled_from(_corpus("avro.txt") or ["00"]),
       edits=EDITS,
       splice=st.booleans())
def test_mutated_records_are_dead_letters_or_results(line: str, other: str, edits, splice: bool) -> None:
    data = bytes.fromhex(line)
    if splice:
        data = data[:len(data) // 2] + bytes.fromhex(other)[len(bytes.fromhex(other)) // 2:]
    try:
        event = CODEC.decode_event(mutate(data, edits))
    except CodecError:
        return  # a dead letter
    fold_one(event)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(line=st.sampled_from(_corpus("jsonl.txt") or ["{}"]), edits=EDITS)
def test_mutated_json_lines_are_dead_letters_or_results(line: str, edits) -> None:
    item = decode_json_line(mutate(line.encode(), edits), 0, 1, CODEC)
    if item.event is not None:
        fold_one(item.event)
    else:
        assert item.reason


if __name__ == "__main__":
    write_corpus()
    print(f"wrote {CORPUS}", file=sys.stderr)
