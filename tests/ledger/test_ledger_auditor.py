"""The ledger auditor fails for the right reasons: ledgers whose invariant sum still holds while a part is
wrong, a child that releases more than it held, a release emitted twice, a parent closed too early. Each
case breaks a ledger behind the fold's back (or hands the auditor outputs the fold did not make) and checks
the auditor names the parent, the term and the event."""

from __future__ import annotations

import pytest

from branch_settlement.processors.ledger.errors import InvariantViolation, LedgerAuditFailure
from branch_settlement.processors.ledger.auditor import LedgerAuditor
from branch_settlement.processors.ledger.outputs import Outputs
from tests.harness import T0, Ledger

pytestmark = pytest.mark.unit


def running(gpus: bool = False) -> Ledger:
    L = Ledger()
    L.tick(T0)
    assert L.open_parent(gpus=4 if gpus else None) == "ok"
    assert L.reserve("A", gpus=2 if gpus else None) == "ok"
    assert L.reserve("B", tokens=30) == "ok"
    assert L.activate("A") == "ok"
    return L


def renew(L: Ledger) -> str:
    return L.send("LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=60_000)


def test_a_remainder_in_the_wrong_term_fails_although_the_sum_holds() -> None:
    L = running()
    tokens = L.view.parent("P")["dimensions"]["tokens"]
    tokens["outstanding"] -= 20  # child A's remainder booked as pending: the invariant's sum still holds
    tokens["pending"] += 20
    with pytest.raises(LedgerAuditFailure) as failure:
        renew(L)
    message = str(failure.value)
    assert "parent 'P' dimension 'tokens'" in message
    assert "outstanding = 30, recomputed 50" in message and "pending = 20, recomputed 0" in message
    assert "at input offset" in message and "LeaseRenewed" in message


def test_committed_that_the_children_do_not_account_for_fails() -> None:
    L = running()
    tokens = L.view.parent("P")["dimensions"]["tokens"]
    tokens["available"] -= 3
    tokens["committed"] += 3
    with pytest.raises(LedgerAuditFailure, match="committed = 3, recomputed 0"):
        renew(L)


def test_counts_of_live_children_are_recounted() -> None:
    L = running()
    L.view.parent("P")["live_children"] -= 1
    with pytest.raises(LedgerAuditFailure, match="live_children/open_children = 1/2, the children say 2/2"):
        renew(L)


def test_a_child_that_releases_more_than_it_held_fails() -> None:
    L = running()
    auditor: LedgerAuditor = L.fold.auditor
    out = Outputs()
    event = L.event("LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=1)
    release = {"release_key": "forged/A/tokens/parent", "parent_id": "P", "child_id": "A", "dimension": "tokens",
               "quantity": 5, "destination": "parent"}
    out.releases.append(release)
    result = {"input_offset": 99, "result": "ok"}
    with pytest.raises(LedgerAuditFailure, match="child 'A' held 20, now holds 20 and released 5: more than it held"):
        auditor.check(L.view, event, result, out, (0, 0, 0, 0))


def test_a_release_key_emitted_twice_fails() -> None:
    L = running()
    assert L.send("ChildCompleted", child_id="A", attempt_id="A1", lease_generation=1, usage={"tokens": 5}) == "ok"
    [release] = L.out.releases
    out = Outputs(releases=[dict(release)])
    event = L.event("LeaseRenewed", child_id="B", attempt_id="B1", lease_generation=1, lease_ttl_ms=1)
    with pytest.raises(LedgerAuditFailure, match="emitted twice"):
        L.fold.auditor.check(L.view, event, {"input_offset": 99, "result": "ok"}, out, (0, 0, 0, 0))


def test_capacity_that_goes_nowhere_fails() -> None:
    """A child settled with its remainder neither released nor committed: the parent's terms were patched to
    keep the sum, the child's conservation still catches it."""
    L = running()
    child = L.view.child("P", "A")
    event = L.event("LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=1)
    child["state"] = "released"  # holds nothing now, released nothing
    L.view.parent("P")["live_children"] -= 1
    L.view.parent("P")["open_children"] -= 1
    tokens = L.view.parent("P")["dimensions"]["tokens"]
    tokens["outstanding"] -= 20
    tokens["available"] += 20
    with pytest.raises(LedgerAuditFailure, match="child 'A' held 20, now holds 0, released 0 and committed 0: "
                                                 "20 went nowhere"):
        L.fold.auditor.check(L.view, event, {"input_offset": 99, "result": "ok"}, Outputs(), (0, 0, 0, 0))


def test_awaiting_confirmation_is_recounted() -> None:
    L = running(gpus=True)
    assert L.send("ChildCompleted", child_id="A", attempt_id="A1", lease_generation=1,
                  usage={"tokens": 5, "gpus": 1}) == "ok"
    gpus = L.view.parent("P")["dimensions"]["gpus"]
    assert gpus["awaiting_confirmation"] == 1
    gpus["awaiting_confirmation"] -= 1
    gpus["available"] += 1
    with pytest.raises(LedgerAuditFailure, match="awaiting_confirmation = 0, recomputed 1"):
        L.send("LeaseRenewed", child_id="B", attempt_id="B1", lease_generation=1, lease_ttl_ms=1)


def test_returned_to_pool_must_match_the_pool_releases() -> None:
    L = running()
    assert L.send("ParentClosed", outcome="failed") == "ok"
    tokens = L.view.parent("P")["dimensions"]["tokens"]
    tokens["returned_to_pool"] -= 10  # B's 30 and the unassigned 50 went to the pool: booked as 70
    tokens["available"] += 10
    with pytest.raises(LedgerAuditFailure, match="returned_to_pool = 70, recomputed 80"):
        renew(L)


def test_a_violation_is_still_an_invariant_violation_for_the_processor() -> None:
    """The processor stops a partition on InvariantViolation: an audit failure is one."""
    assert issubclass(LedgerAuditFailure, InvariantViolation)


def test_an_invariant_violation_names_offset_and_the_children() -> None:
    L = running()
    tokens = L.view.parent("P")["dimensions"]["tokens"]
    tokens["outstanding"] -= 45  # A's 20 and 25 of B's 30: completing A takes outstanding below 0
    tokens["pending"] += 45
    with pytest.raises(InvariantViolation) as failure:
        L.fold.apply(L.event("ChildCompleted", child_id="A", attempt_id="A1", lease_generation=1,
                             usage={"tokens": 3}), 41, L.out)
    message = str(failure.value)
    assert "outstanding = -" in message and "at input offset 41" in message
    assert "tokens.pending = 45, its children hold 0" in message
    assert "children this event changed: A (released, attempt A1, holds nothing)" in message
