"""A loan's idempotency keys are its own: no other event may be stored under one (SPEC §9). An event that took
`P/loan/L1/return` made L1's own return an idempotency_conflict forever: its capacity stuck in `lent` and the
parent never closed (found by review)."""

from __future__ import annotations

import pytest

from tests.harness import T0, Ledger

pytestmark = pytest.mark.unit


def lending_parent() -> Ledger:
    L = Ledger()
    L.tick(T0)
    assert L.send("ParentReserved", capacity={"tokens": {"quantity": 100, "kind": "logical"}}, lease_ttl_ms=3_600_000,
                  policy={"max_live_children": 8, "reconciliation_timeout_ms": 600_000,
                          "lending_limit": {"tokens": 40}}) == "ok"
    assert L.send("LoanRequested", key="P/loan/L1/request", loan_id="L1", borrower="batch",
                  quantities={"tokens": 10}) == "ok"
    return L


@pytest.mark.parametrize("key", ["P/loan/L1/return", "P/loan/L1/request", "P/loan/L9/return"])
def test_another_event_cannot_take_a_loans_key(key) -> None:
    L = lending_parent()
    assert L.send("ChildReserved", key=key, child_id="loan", branch_id="b", attempt_id="L1",
                  quantities={"tokens": 5}) == "invalid_event"
    assert "the loans' own keys" in L.out.results[-1]["detail"]
    assert L.send("ParentClosed", outcome="succeeded") == "ok"
    assert L.send("LoanReturned", key="P/loan/L1/return", loan_id="L1", usage={"tokens": 2}) == "ok"
    assert L.status() == "closed" and L.balance()["lent"] == 0


def test_a_child_named_loan_keeps_its_ordinary_keys() -> None:
    L = lending_parent()
    assert L.send("ChildReserved", key="P/loan/L1/1", child_id="loan", branch_id="b", attempt_id="L1",
                  quantities={"tokens": 5}) == "ok"
