"""Multi-step stories of SPEC §4–§10 that a single transition row cannot show."""

from __future__ import annotations

import pytest

from branch_settlement.processors.ledger.errors import InvariantViolation
from tests.harness import T0, Ledger
from tests.ledger.test_transitions import activated, complete, fail, fresh, reserved, usage

pytestmark = pytest.mark.unit


def test_duplicate_returns_the_stored_result_and_changes_nothing() -> None:
    L = Ledger()
    activated(L)
    event = L.event("ChildCompleted", key="P/A/A1/1", child_id="A", attempt_id="A1", lease_generation=1,
                    usage={"tokens": 12})
    assert L.apply(event)["result"] == "ok"
    redelivery = dict(event, event_id="other-delivery", occurred_at_ms=event["occurred_at_ms"] + 99)
    result = L.apply(redelivery)
    assert result["result"] == "duplicate"
    assert "had result ok" in result["detail"]
    assert L.balance()["available"] == 88
    assert L.releases() == [("A", "tokens", 8, "parent")]


def test_same_key_with_another_payload_is_a_conflict() -> None:
    L = Ledger()
    activated(L)
    first = L.event("ChildCompleted", key="P/A/A1/1", child_id="A", attempt_id="A1", lease_generation=1,
                    usage={"tokens": 12})
    assert L.apply(first)["result"] == "ok"
    other = dict(first, usage={"tokens": 2})
    assert L.apply(other)["result"] == "idempotency_conflict"
    assert L.balance()["committed"] == 12


def test_rejected_event_can_be_retried_under_the_same_key() -> None:
    L = Ledger()
    fresh(L)
    L.reserve("B", tokens=90)
    event = L.event("ChildReserved", key="P/A/A1/reserve", child_id="A", branch_id="A", attempt_id="A1",
                    quantities={"tokens": 20})
    assert L.apply(event)["result"] == "exceeds_available"
    L.send("ChildSkipped", child_id="B", attempt_id="B1")
    assert L.apply(event)["result"] == "ok"
    assert L.balance()["outstanding"] == 20


def test_retry_keeps_the_remainder_and_fences_the_old_attempt() -> None:
    L = Ledger()
    activated(L)
    assert fail(L, tokens=5, retry="A2") == "ok"
    child = L.child("A")
    assert (child["attempt_id"], child["lease_generation"], child["reserved"]) == ("A2", 2, {"tokens": 15})
    assert L.releases() == []  # nothing passed through the parent
    # the old attempt can no longer settle the child
    assert complete(L, 3, attempt="A1") == "superseded_attempt"
    assert L.activate("A", attempt="A2", generation=2) == "ok"
    assert complete(L, 10, attempt="A2", generation=2) == "ok"
    assert L.balance() == dict(L.balance(), available=85, outstanding=0, committed=15)
    assert L.releases() == [("A", "tokens", 5, "parent")]


def test_renewal_postpones_expiry() -> None:
    L = Ledger()
    activated(L)
    L.tick(T0 + 50_000)
    assert L.send("LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=60_000) == "ok"
    L.tick(T0 + 61_000)
    assert L.state("A") == "activated"
    L.tick(T0 + 110_001)
    assert L.state("A") == "reconciling"
    assert L.balance()["pending"] == 20


def test_speculative_winner_fences_and_cancels_losers() -> None:
    L = Ledger()
    fresh(L)
    for child in ("X1", "X2", "X3"):
        L.reserve(child, tokens=10, attempt=child, branch="X")
    L.activate("X1", attempt="X1")
    L.activate("X2", attempt="X2")
    assert L.send("SpeculativeWinner", branch_id="X", winner_attempt_id="X1") == "ok"
    assert [L.state(c) for c in ("X1", "X2", "X3")] == ["activated", "cancel_requested", "released"]
    assert L.releases() == [("X3", "tokens", 10, "parent")]  # never dispatched: all of it returns
    # the loser still settles with its real usage
    assert L.send("CancelAcknowledged", child_id="X2", attempt_id="X2", lease_generation=1,
                  usage={"tokens": 4}) == "ok"
    assert L.balance()["committed"] == 4
    assert L.activate("X3", attempt="X3") == "dispatch_fenced"
    assert L.send("SpeculativeWinner", branch_id="X", winner_attempt_id="X2") == "invalid_transition"
    assert L.send("SpeculativeWinner", branch_id="X", winner_attempt_id="nobody") == "unknown_child"


def test_physical_dimension_waits_for_the_scheduler() -> None:
    L = Ledger()
    L.tick(T0)
    L.open_parent(tokens=100, gpus=4)
    L.reserve("A", tokens=20, gpus=2)
    L.activate("A")
    assert L.send("ChildCompleted", child_id="A", attempt_id="A1", lease_generation=1,
                  usage={"tokens": 10, "gpus": 0}) == "ok"
    assert L.balance("gpus") == dict(L.balance("gpus"), available=2, outstanding=0, awaiting_confirmation=2)
    assert L.releases() == [("A", "tokens", 10, "parent")]
    assert L.send("SchedulerReleaseConfirmed", child_id="A", attempt_id="A1", dimension="gpus") == "ok"
    assert L.balance("gpus") == dict(L.balance("gpus"), available=4, awaiting_confirmation=0)
    assert L.releases()[-1] == ("A", "gpus", 2, "parent")
    assert L.send("SchedulerReleaseConfirmed", child_id="A", attempt_id="A1",
                  dimension="gpus") == "invalid_transition"


def test_close_waits_for_running_children_then_settles_to_the_pool() -> None:
    L = Ledger()
    activated(L)
    L.reserve("B", tokens=30)
    assert L.send("ParentClosed", outcome="succeeded") == "ok"
    assert L.status() == "closing"
    assert L.state("B") == "released"
    assert L.activate("B") == "parent_closed"
    assert L.reserve("C") == "parent_closed"
    assert complete(L, 12) == "ok"
    assert L.status() == "closed"
    assert L.balance() == dict(L.balance(), available=0, outstanding=0, committed=12, returned_to_pool=88)
    assert [r[3] for r in L.releases()] == ["global_pool"] * 3
    [settled] = L.out.settled
    assert settled["outcome"] == "succeeded"
    assert settled["dimensions"]["tokens"]["returned_to_pool"] == 88
    assert usage(L, 1) == "parent_closed"  # the tombstone answers late events


def test_parent_lease_expiry_fences_and_reconciles() -> None:
    L = Ledger()
    L.tick(T0)
    L.open_parent(lease_ttl_ms=100_000)
    L.reserve("A")
    L.reserve("B")
    L.activate("A", lease_ttl_ms=1_000_000)
    L.tick(T0 + 100_000)
    assert L.status() == "expired"
    assert L.state("B") == "released"
    assert L.balance() == dict(L.balance(), available=0, outstanding=20, returned_to_pool=80)
    assert complete(L, 5) == "ok"
    assert L.status() == "closed"
    assert L.out.settled[-1]["outcome"] == "expired"
    assert L.balance()["returned_to_pool"] == 95


def test_stranded_child_keeps_the_parent_open_until_an_operator_resolves_it() -> None:
    L = Ledger()
    activated(L)
    L.send("ParentClosed", outcome="failed")
    L.tick(T0 + 61_000)
    L.tick(T0 + 61_000 + 600_000)
    assert L.state("A") == "stranded"
    assert L.status() == "closing"
    assert L.send("ReconciliationResolved", child_id="A", attempt_id="A1", usage={"tokens": 9},
                  resolution="operator") == "ok"
    assert L.status() == "closed"
    assert L.balance() == dict(L.balance(), committed=9, pending=0, returned_to_pool=91)


def test_overdraft_is_recorded_not_hidden() -> None:
    L = Ledger()
    activated(L)
    L.reserve("B", tokens=80)
    assert usage(L, 50, final=True) == "overdrawn"
    balance = L.balance()
    assert (balance["committed"], balance["overdrawn"], balance["available"]) == (50, 30, 0)
    assert any("overdrawn" in a["note"] for a in L.out.audits)


def test_every_state_change_is_audited_with_its_position() -> None:
    L = Ledger()
    reserved(L)
    before = len(L.out.audits)
    L.activate("A")
    [audit] = L.out.audits[before:]
    assert (audit["prior_state"], audit["new_state"], audit["child_id"]) == ("reserved", "activated", "A")
    assert audit["input_offset"] == L.out.results[-1]["input_offset"]
    assert audit["ledger_time_ms"] == T0


def test_an_invariant_violation_stops_with_a_typed_error() -> None:
    L = Ledger()
    activated(L)
    L.view.parent("P")["dimensions"]["tokens"]["available"] += 1  # corrupt the ledger behind the fold's back
    with pytest.raises(InvariantViolation, match="parent 'P' dimension 'tokens'"):
        complete(L, 3)


def test_ids_with_nul_are_invalid() -> None:
    L = Ledger()
    fresh(L)
    assert L.reserve("A\x00B") == "invalid_event"
