"""The retry hand-off (SPEC §4) from every state it may start in, checked on every balance term after every
step: the remainder is held in `outstanding` while the child is live and in `pending` while it is in
reconciliation, and a hand-off out of reconciliation moves it back to `outstanding` in the same step.

The first case is the sequence that halted partitions (`outstanding < 0` two events after the hand-off)."""

from __future__ import annotations

import pytest

from tests.harness import T0, Ledger

pytestmark = pytest.mark.unit

LEASE_END = T0 + 2_000  # past the 1 s child lease granted below


def balances(L: Ledger, dim: str = "tokens") -> dict:
    b = L.balance(dim)
    return {term: b[term] for term in ("available", "outstanding", "pending", "awaiting_confirmation",
                                       "returned_to_pool", "committed", "overdrawn")}


def terms(available=80, outstanding=0, pending=0, awaiting_confirmation=0, returned_to_pool=0, committed=0,
          overdrawn=0) -> dict:
    return dict(available=available, outstanding=outstanding, pending=pending,
                awaiting_confirmation=awaiting_confirmation, returned_to_pool=returned_to_pool,
                committed=committed, overdrawn=overdrawn)


def expired_child(L: Ledger, gpus: int | None = None) -> None:
    """Parent of 100 tokens (and 10 GPUs when `gpus`), child A of 20 (and `gpus`), its 1 s lease run out."""
    L.tick(T0)
    assert L.open_parent(gpus=10 if gpus is not None else None) == "ok"
    assert L.reserve("A", gpus=gpus) == "ok"
    assert L.activate("A", lease_ttl_ms=1_000) == "ok"
    assert L.tick(LEASE_END) == "ok"
    assert L.state("A") == "reconciling"
    assert balances(L) == terms(pending=20)


def outcome(L: Ledger, etype: str, usage: dict, retry: str | None = "A2", attempt: str = "A1",
            generation: int = 1) -> str:
    fields = dict(child_id="A", attempt_id=attempt, lease_generation=generation, usage=usage,
                  usage_uncertain=False)
    if etype == "ChildFailed":
        fields.update(activated=True, reason="worker lost")
    if retry:
        fields["retry_attempt_id"] = retry
    return L.send(etype, **fields)


def complete(L: Ledger, tokens: int, attempt: str, generation: int) -> str:
    return L.send("ChildCompleted", child_id="A", attempt_id=attempt, lease_generation=generation,
                  usage={"tokens": tokens})


@pytest.mark.parametrize("etype", ["ChildFailed", "CancelAcknowledged"])
def test_hand_off_after_lease_expiry_then_retry_completes(etype: str) -> None:
    L = Ledger()
    expired_child(L)
    assert outcome(L, etype, {"tokens": 5}) == "ok"
    assert L.state("A") == "reserved"
    assert L.child("A")["attempt_id"] == "A2"
    assert balances(L) == terms(outstanding=15, committed=5)
    assert L.activate("A", attempt="A2", generation=2) == "ok"
    assert complete(L, 3, attempt="A2", generation=2) == "ok"
    assert L.state("A") == "released"
    assert balances(L) == terms(available=92, committed=8)
    assert L.releases()[-1] == ("A", "tokens", 12, "parent")


def test_hand_off_after_uncertain_failure() -> None:
    L = Ledger()
    L.tick(T0)
    L.open_parent()
    L.reserve("A")
    L.activate("A")
    assert L.send("ChildFailed", child_id="A", attempt_id="A1", lease_generation=1, activated=True,
                  usage_uncertain=True, reason="lost") == "ok"
    assert balances(L) == terms(pending=20)
    assert outcome(L, "ChildFailed", {"tokens": 4}) == "ok"
    assert balances(L) == terms(outstanding=16, committed=4)
    assert L.activate("A", attempt="A2", generation=2) == "ok"
    assert L.tick(T0 + 120_000) == "ok"  # the retry's lease expires too: its remainder goes to pending
    assert balances(L) == terms(pending=16, committed=4)
    assert complete(L, 6, attempt="A2", generation=2) == "ok"
    assert balances(L) == terms(available=90, committed=10)


def test_hand_off_keeps_the_capacity_from_siblings() -> None:
    """The remainder handed to the retry is never available to a sibling in between, and the books match
    when siblings take everything else."""
    L = Ledger()
    expired_child(L)
    assert L.reserve("B", tokens=80) == "ok"
    assert outcome(L, "ChildFailed", {"tokens": 5}) == "ok"
    assert L.reserve("C", tokens=1) == "exceeds_available"
    assert balances(L) == terms(available=0, outstanding=95, committed=5)
    assert L.activate("A", attempt="A2", generation=2) == "ok"
    assert complete(L, 15, attempt="A2", generation=2) == "ok"
    assert balances(L) == terms(available=0, outstanding=80, committed=20)


def test_hand_off_with_a_physical_dimension() -> None:
    L = Ledger()
    expired_child(L, gpus=2)
    assert balances(L, "gpus") == dict(terms(available=8, pending=2))
    assert outcome(L, "ChildFailed", {"tokens": 5, "gpus": 1}) == "ok"
    assert balances(L, "gpus") == terms(available=8, outstanding=1, committed=1)
    assert L.activate("A", attempt="A2", generation=2) == "ok"
    assert complete(L, 1, attempt="A2", generation=2) == "ok"
    assert balances(L, "gpus") == terms(available=8, awaiting_confirmation=1, committed=1)
    assert L.send("SchedulerReleaseConfirmed", child_id="A", attempt_id="A2", dimension="gpus") == "ok"
    assert balances(L, "gpus") == terms(available=9, committed=1)


def test_hand_off_from_reconciliation_needs_the_same_generation() -> None:
    L = Ledger()
    expired_child(L)
    assert outcome(L, "ChildFailed", {"tokens": 5}, generation=2) == "invalid_transition"
    assert outcome(L, "ChildFailed", {"tokens": 5}, generation=0) == "stale_lease_generation"
    assert outcome(L, "ChildFailed", {"tokens": 5}, attempt="A0") == "superseded_attempt"
    assert balances(L) == terms(pending=20)


def test_hand_off_on_a_closing_parent_settles_to_the_pool() -> None:
    """SPEC §4: a hand-off needs an open parent; on a closing one the child settles, its remainder to the pool."""
    L = Ledger()
    expired_child(L)
    assert L.send("ParentClosed", outcome="failed") == "ok"
    assert balances(L) == terms(available=0, pending=20, returned_to_pool=80)
    assert outcome(L, "ChildFailed", {"tokens": 5}) == "ok"
    assert L.state("A") == "released"
    assert balances(L) == terms(available=0, returned_to_pool=95, committed=5)
    assert L.status() == "closed"


def test_stale_report_of_the_replaced_attempt_after_hand_off() -> None:
    L = Ledger()
    expired_child(L)
    assert outcome(L, "ChildFailed", {"tokens": 5}) == "ok"
    assert complete(L, 20, attempt="A1", generation=1) == "superseded_attempt"
    assert L.send("ReconciliationResolved", child_id="A", attempt_id="A1", usage={"tokens": 20},
                  resolution="late_report") == "superseded_attempt"
    assert balances(L) == terms(outstanding=15, committed=5)
    # the retry's reconciliation timer, armed by the expiry, no longer strands the live child
    assert L.tick(T0 + 700_000) == "ok"  # past the 600 s reconciliation timeout, before the parent lease
    assert L.state("A") == "reserved"
