"""Table-driven transitions: every event of SPEC §4 and every state of §5, each row asserting the result
code, the balances after it and the child's state. Parent capacity is 100 tokens unless a row says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from tests.harness import T0, Ledger

pytestmark = pytest.mark.unit

LEASE_END = T0 + 61_000  # a tick past the 60 s child lease
RECON_END = LEASE_END + 600_001  # past the 600 s reconciliation timeout


# -- setups: each leaves the ledger in a named state ------------------------------------------------------


def fresh(L: Ledger) -> None:
    L.tick(T0)
    assert L.open_parent() == "ok"


def reserved(L: Ledger) -> None:
    fresh(L)
    assert L.reserve("A") == "ok"


def activated(L: Ledger) -> None:
    reserved(L)
    assert L.activate("A") == "ok"


def partial(L: Ledger) -> None:
    activated(L)
    assert usage(L, 5, report="r1") == "ok"


def cancel_requested(L: Ledger) -> None:
    activated(L)
    assert L.send("CancelRequested", child_id="A", attempt_id="A1", reason="user") == "ok"


def reconciling(L: Ledger) -> None:
    activated(L)
    assert L.tick(LEASE_END) == "ok"


def stranded(L: Ledger) -> None:
    reconciling(L)
    assert L.tick(RECON_END) == "ok"


def released(L: Ledger) -> None:
    activated(L)
    assert complete(L, 12) == "ok"


def closed(L: Ledger) -> None:
    reserved(L)
    assert L.send("ParentClosed", outcome="succeeded") == "ok"


def lending(L: Ledger) -> None:
    """A parent of 100 tokens lending at most 40, with child A reserved (20): 80 available."""
    L.tick(T0)
    assert L.open_parent(lending_limit={"tokens": 40}) == "ok"
    assert L.reserve("A") == "ok"


def lent(L: Ledger) -> None:
    """`lending`, and two loans out: L1 (20 tokens), then L2 (15): 45 available, 35 lent."""
    lending(L)
    assert L.lend("L1", 20) == "ok"
    assert L.lend("L2", 15) == "ok"


def recalled(L: Ledger) -> None:
    """`lent`, and a sibling B of 50 tokens waiting for L2 to come back (L2 asked back)."""
    lent(L)
    assert L.reserve("B", tokens=50) == "awaiting_revocation"


def lent_closing(L: Ledger) -> None:
    """`lent`, A activated, then the parent closed: both loans asked back, 45 went to the pool."""
    lent(L)
    assert L.activate("A") == "ok"
    assert L.send("ParentClosed", outcome="succeeded") == "ok"


def usage(L: Ledger, tokens: int, report: str = "r", final: bool = False, attempt: str = "A1", generation: int = 1,
          child: str = "A") -> str:
    return L.send("UsageReported", child_id=child, attempt_id=attempt, lease_generation=generation,
                  usage_report_id=report, usage={"tokens": tokens}, final=final)


def complete(L: Ledger, tokens: int, attempt: str = "A1", generation: int = 1, child: str = "A") -> str:
    return L.send("ChildCompleted", child_id=child, attempt_id=attempt, lease_generation=generation,
                  usage={"tokens": tokens})


def fail(L: Ledger, activated_: bool = True, tokens: int | None = None, uncertain: bool = False,
         retry: str | None = None, generation: int = 1) -> str:
    fields = dict(child_id="A", attempt_id="A1", lease_generation=generation, activated=activated_,
                  usage_uncertain=uncertain, reason="boom")
    if tokens is not None:
        fields["usage"] = {"tokens": tokens}
    if retry:
        fields["retry_attempt_id"] = retry
    return L.send("ChildFailed", **fields)


def ack(L: Ledger, tokens: int | None = None, uncertain: bool = False, retry: str | None = None) -> str:
    fields = dict(child_id="A", attempt_id="A1", lease_generation=1, usage_uncertain=uncertain)
    if tokens is not None:
        fields["usage"] = {"tokens": tokens}
    if retry:
        fields["retry_attempt_id"] = retry
    return L.send("CancelAcknowledged", **fields)


def resolve(L: Ledger, tokens: int, attempt: str = "A1") -> str:
    return L.send("ReconciliationResolved", child_id="A", attempt_id=attempt, usage={"tokens": tokens},
                  resolution="operator")


@dataclass
class Row:
    name: str
    setup: Callable[[Ledger], None]
    act: Callable[[Ledger], str]
    result: str
    balance: dict
    state: str | None = None  # of child A, when given


ROWS = [
    # ParentReserved
    Row("parent reserved", lambda L: L.tick(T0), lambda L: L.open_parent(), "ok",
        dict(capacity=100, available=100, outstanding=0, committed=0)),
    Row("parent reserved twice", fresh, lambda L: L.open_parent(tokens=50), "invalid_transition",
        dict(capacity=100, available=100)),
    Row("parent reserved after close", closed, lambda L: L.open_parent(), "parent_closed",
        dict(available=0, returned_to_pool=100)),
    Row("parent reserved with unknown kind", lambda L: L.tick(T0),
        lambda L: L.send("ParentReserved", capacity={"tokens": {"quantity": 1, "kind": "quantum"}},
                         lease_ttl_ms=1, policy={"max_live_children": 1, "reconciliation_timeout_ms": 1,
                                                 "lending_limit": {}}), "invalid_event", {}),
    # ChildReserved
    Row("child reserved", fresh, lambda L: L.reserve("A"), "ok", dict(available=80, outstanding=20), "reserved"),
    Row("child reserved beyond available", fresh, lambda L: L.reserve("A", tokens=101), "exceeds_available",
        dict(available=100, outstanding=0)),
    Row("child reserved beyond fan-out", lambda L: (L.tick(T0), L.open_parent(max_live=1), L.reserve("B")),
        lambda L: L.reserve("A"), "fanout_exceeded", dict(available=80, outstanding=20)),
    Row("child reserved for unknown parent", lambda L: None, lambda L: L.reserve("A"), "unknown_parent", {}),
    Row("child reserved after close", closed, lambda L: L.reserve("B"), "parent_closed",
        dict(available=0, returned_to_pool=100), "released"),
    Row("child reserved twice", reserved, lambda L: L.reserve("A", tokens=5), "invalid_transition",
        dict(available=80, outstanding=20), "reserved"),
    Row("child reserved with unknown dimension", fresh,
        lambda L: L.send("ChildReserved", child_id="A", branch_id="A", attempt_id="A1", quantities={"cpu": 1}),
        "invalid_event", dict(available=100)),
    Row("child reserved with negative quantity", fresh, lambda L: L.reserve("A", tokens=-1), "invalid_event",
        dict(available=100)),
    # ChildActivated
    Row("child activated", reserved, lambda L: L.activate("A"), "ok", dict(available=80, outstanding=20),
        "activated"),
    Row("activation after skip", lambda L: (reserved(L), L.send("ChildSkipped", child_id="A", attempt_id="A1")),
        lambda L: L.activate("A"), "dispatch_fenced", dict(available=100, outstanding=0), "released"),
    Row("activation after expiry", reconciling, lambda L: L.activate("A", generation=2), "dispatch_fenced",
        dict(pending=20, outstanding=0), "reconciling"),
    Row("activation after cancel request", lambda L: (reserved(L), L.send(
        "CancelRequested", child_id="A", attempt_id="A1")), lambda L: L.activate("A"), "dispatch_fenced",
        dict(outstanding=20), "cancel_requested"),
    Row("activation by another attempt", reserved, lambda L: L.activate("A", attempt="A9"), "superseded_attempt",
        dict(outstanding=20), "reserved"),
    Row("activation of unknown child", fresh, lambda L: L.activate("Z"), "unknown_child", dict(available=100)),
    Row("activation after parent close", closed, lambda L: L.activate("A"), "parent_closed",
        dict(returned_to_pool=100), "released"),
    Row("activation twice", activated, lambda L: L.activate("A", generation=1), "invalid_transition",
        dict(outstanding=20), "activated"),
    Row("activation with superseded generation", lambda L: (activated(L), fail(L, tokens=5, retry="A2")),
        lambda L: L.activate("A", attempt="A2", generation=1), "stale_lease_generation",
        dict(outstanding=15, committed=5), "reserved"),
    # LeaseRenewed
    Row("lease renewed", activated, lambda L: L.send("LeaseRenewed", child_id="A", attempt_id="A1",
                                                     lease_generation=1, lease_ttl_ms=120_000), "ok",
        dict(outstanding=20), "activated"),
    Row("lease renewed with new generation", activated, lambda L: L.send(
        "LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=2, lease_ttl_ms=1), "ok",
        dict(outstanding=20), "activated"),
    Row("lease renewed with stale generation", lambda L: (activated(L), L.send(
        "LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=2, lease_ttl_ms=1)),
        lambda L: L.send("LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=1),
        "stale_lease_generation", dict(outstanding=20), "activated"),
    Row("lease renewed before activation", reserved, lambda L: L.send(
        "LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=1),
        "invalid_transition", dict(outstanding=20), "reserved"),
    Row("lease renewed after expiry", reconciling, lambda L: L.send(
        "LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=1),
        "invalid_transition", dict(pending=20), "reconciling"),
    Row("lease renewed after settlement", released, lambda L: L.send(
        "LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=1),
        "already_settled", dict(available=88, committed=12), "released"),
    # UsageReported
    Row("usage reported", activated, lambda L: usage(L, 5), "ok", dict(outstanding=15, committed=5),
        "partially_consumed"),
    Row("final usage reported", partial, lambda L: usage(L, 3, report="r2", final=True), "ok",
        dict(available=92, outstanding=0, committed=8), "released"),
    Row("final usage equal to the reservation", partial, lambda L: usage(L, 15, report="r2", final=True), "ok",
        dict(available=80, outstanding=0, committed=20), "committed"),
    Row("usage on a reserved child implies activation", reserved, lambda L: usage(L, 5, generation=0), "ok",
        dict(outstanding=15, committed=5), "partially_consumed"),
    Row("usage overrun drawn from available", activated, lambda L: usage(L, 30, final=True), "ok",
        dict(available=70, outstanding=0, committed=30, overdrawn=0), "committed"),
    Row("usage overrun beyond the parent", lambda L: (activated(L), L.reserve("B", tokens=80)),
        lambda L: usage(L, 30, final=True), "overdrawn",
        dict(available=0, outstanding=80, committed=30, overdrawn=10), "committed"),
    Row("usage of a stale lease generation", lambda L: (activated(L), L.send(
        "LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=2, lease_ttl_ms=60_000)),
        lambda L: usage(L, 5, generation=1), "stale_lease_generation", dict(outstanding=20, committed=0),
        "activated"),
    Row("usage of a superseded attempt", activated, lambda L: usage(L, 5, attempt="A0"), "superseded_attempt",
        dict(outstanding=20, committed=0), "activated"),
    Row("usage after settlement", released, lambda L: usage(L, 5), "already_settled",
        dict(available=88, committed=12), "released"),
    Row("usage report counted twice", partial, lambda L: usage(L, 5, report="r1"), "duplicate_usage_report",
        dict(outstanding=15, committed=5), "partially_consumed"),
    Row("late usage in reconciliation", reconciling, lambda L: usage(L, 5), "ok",
        dict(pending=15, committed=5, available=80), "reconciling"),
    Row("late final usage in reconciliation", reconciling, lambda L: usage(L, 5, final=True), "ok",
        dict(pending=0, committed=5, available=95), "released"),
    Row("late usage of another generation in reconciliation", reconciling, lambda L: usage(L, 5, generation=2),
        "invalid_transition", dict(pending=20, committed=0), "reconciling"),
    Row("usage for a stranded child", stranded, lambda L: usage(L, 5), "invalid_transition",
        dict(pending=20, committed=0), "stranded"),
    Row("usage with unknown dimension", activated, lambda L: L.send(
        "UsageReported", child_id="A", attempt_id="A1", lease_generation=1, usage_report_id="x",
        usage={"cpu": 1}), "invalid_event", dict(outstanding=20)),
    Row("usage for unknown child", activated, lambda L: usage(L, 5, child="Z"), "unknown_child",
        dict(outstanding=20)),
    # ChildCompleted
    Row("completed below reservation", activated, lambda L: complete(L, 12), "ok",
        dict(available=88, outstanding=0, committed=12), "released"),
    Row("completed at reservation", activated, lambda L: complete(L, 20), "ok",
        dict(available=80, outstanding=0, committed=20), "committed"),
    Row("completed counts earlier usage", partial, lambda L: complete(L, 12), "ok",
        dict(available=88, committed=12), "released"),
    Row("completed below committed usage never reverses it", lambda L: (activated(L), usage(L, 15)),
        lambda L: complete(L, 12), "ok", dict(available=85, committed=15), "released"),
    Row("completed after expiry (late report)", reconciling, lambda L: complete(L, 5), "ok",
        dict(available=95, pending=0, committed=5), "released"),
    Row("completed twice with another key", released, lambda L: complete(L, 12), "already_settled",
        dict(available=88, committed=12), "released"),
    # ChildSkipped
    Row("skipped before activation", reserved, lambda L: L.send("ChildSkipped", child_id="A", attempt_id="A1"),
        "ok", dict(available=100, outstanding=0), "released"),
    Row("skipped after cancel request, never activated", lambda L: (reserved(L), L.send(
        "CancelRequested", child_id="A", attempt_id="A1")),
        lambda L: L.send("ChildSkipped", child_id="A", attempt_id="A1"), "ok", dict(available=100), "released"),
    Row("skipped after activation", activated, lambda L: L.send("ChildSkipped", child_id="A", attempt_id="A1"),
        "invalid_transition", dict(outstanding=20), "activated"),
    Row("skipped after settlement", released, lambda L: L.send("ChildSkipped", child_id="A", attempt_id="A1"),
        "already_settled", dict(available=88), "released"),
    # CancelRequested
    Row("cancel requested", activated, lambda L: L.send("CancelRequested", child_id="A", attempt_id="A1"), "ok",
        dict(outstanding=20, available=80), "cancel_requested"),
    Row("cancel requested again", cancel_requested, lambda L: L.send(
        "CancelRequested", child_id="A", attempt_id="A1"), "ok", dict(outstanding=20), "cancel_requested"),
    Row("cancel requested in reconciliation", reconciling, lambda L: L.send(
        "CancelRequested", child_id="A", attempt_id="A1"), "invalid_transition", dict(pending=20), "reconciling"),
    Row("cancel requested after settlement", released, lambda L: L.send(
        "CancelRequested", child_id="A", attempt_id="A1"), "already_settled", dict(available=88), "released"),
    # CancelAcknowledged
    Row("cancel acknowledged with usage", cancel_requested, lambda L: ack(L, tokens=4), "ok",
        dict(available=96, outstanding=0, committed=4), "released"),
    Row("cancel acknowledged with uncertain usage", cancel_requested, lambda L: ack(L, uncertain=True), "ok",
        dict(available=80, outstanding=0, pending=20), "reconciling"),
    Row("cancel acknowledged handing to a retry", cancel_requested, lambda L: ack(L, tokens=5, retry="A2"), "ok",
        dict(available=80, outstanding=15, committed=5), "reserved"),
    Row("cancel acknowledged without usage", cancel_requested, lambda L: ack(L), "invalid_event",
        dict(outstanding=20), "cancel_requested"),
    Row("cancel acknowledged with usage and uncertainty", cancel_requested,
        lambda L: ack(L, tokens=1, uncertain=True), "invalid_event", dict(outstanding=20), "cancel_requested"),
    Row("cancel acknowledged uncertain with a retry", cancel_requested,
        lambda L: ack(L, uncertain=True, retry="A2"), "invalid_event", dict(outstanding=20), "cancel_requested"),
    # ChildFailed
    Row("failed before activation", reserved, lambda L: fail(L, activated_=False, generation=0), "ok",
        dict(available=100, outstanding=0, committed=0), "released"),
    Row("failed with known usage", activated, lambda L: fail(L, tokens=7), "ok",
        dict(available=93, outstanding=0, committed=7), "released"),
    Row("failed with uncertain usage", activated, lambda L: fail(L, uncertain=True), "ok",
        dict(available=80, pending=20), "reconciling"),
    Row("failed handing to a retry", activated, lambda L: fail(L, tokens=5, retry="A2"), "ok",
        dict(available=80, outstanding=15, committed=5), "reserved"),
    Row("failed 'before activation' that the ledger activated", activated,
        lambda L: fail(L, activated_=False), "ok", dict(available=80, pending=20), "reconciling"),
    Row("failed after activation without usage", activated, lambda L: fail(L), "invalid_event",
        dict(outstanding=20), "activated"),
    Row("failed after settlement", released, lambda L: fail(L, tokens=1), "already_settled",
        dict(available=88), "released"),
    # ReservationTransferred
    Row("reservation transferred", reserved, lambda L: L.send(
        "ReservationTransferred", child_id="A", from_attempt_id="A1", to_attempt_id="A2"), "ok",
        dict(outstanding=20), "reserved"),
    Row("reservation transferred after activation", activated, lambda L: L.send(
        "ReservationTransferred", child_id="A", from_attempt_id="A1", to_attempt_id="A2"), "invalid_transition",
        dict(outstanding=20), "activated"),
    Row("reservation transferred from a non-holder", reserved, lambda L: L.send(
        "ReservationTransferred", child_id="A", from_attempt_id="A0", to_attempt_id="A2"), "superseded_attempt",
        dict(outstanding=20), "reserved"),
    # ReconciliationResolved
    Row("reconciliation resolved", reconciling, lambda L: resolve(L, 5), "ok",
        dict(available=95, pending=0, committed=5), "released"),
    Row("stranded child resolved by an operator", stranded, lambda L: resolve(L, 20), "ok",
        dict(available=80, pending=0, committed=20), "committed"),
    Row("reconciliation resolved for a live child", activated, lambda L: resolve(L, 5), "invalid_transition",
        dict(outstanding=20), "activated"),
    Row("reconciliation resolved after settlement", released, lambda L: resolve(L, 5), "already_settled",
        dict(available=88), "released"),
    # UsageAdjustment
    Row("usage adjusted after settlement", released, lambda L: L.send(
        "UsageAdjustment", child_id="A", attempt_id="A1", usage={"tokens": 3}, reason="late invoice"), "ok",
        dict(available=85, committed=15, overdrawn=0), "released"),
    Row("usage adjusted beyond the parent", lambda L: (released(L), L.reserve("B", tokens=88)), lambda L: L.send(
        "UsageAdjustment", child_id="A", attempt_id="A1", usage={"tokens": 3}), "overdrawn",
        dict(available=0, committed=15, overdrawn=3), "released"),
    Row("usage adjusted before settlement", activated, lambda L: L.send(
        "UsageAdjustment", child_id="A", attempt_id="A1", usage={"tokens": 3}), "invalid_transition",
        dict(outstanding=20, committed=0), "activated"),
    # ParentClosed
    Row("parent closed with nothing live", fresh, lambda L: L.send("ParentClosed", outcome="succeeded"), "ok",
        dict(available=0, returned_to_pool=100)),
    Row("parent closed with a reserved child", reserved, lambda L: L.send("ParentClosed", outcome="cancelled"),
        "ok", dict(available=0, outstanding=0, returned_to_pool=100), "released"),
    Row("parent closed with a running child", activated, lambda L: L.send("ParentClosed", outcome="failed"),
        "ok", dict(available=0, outstanding=20, returned_to_pool=80), "activated"),
    Row("parent closed twice while closing", lambda L: (activated(L), L.send("ParentClosed", outcome="failed")),
        lambda L: L.send("ParentClosed", outcome="failed"), "invalid_transition",
        dict(outstanding=20, returned_to_pool=80)),
    Row("parent closed after closed", closed, lambda L: L.send("ParentClosed", outcome="failed"), "parent_closed",
        dict(returned_to_pool=100)),
    Row("parent closed with unknown outcome", fresh, lambda L: L.send("ParentClosed", outcome="meh"),
        "invalid_event", dict(available=100)),
    # LoanRequested (explicit borrowing)
    Row("loan within the limit", lending, lambda L: L.lend("L1", 30), "ok",
        dict(available=50, outstanding=20, lent=30), "reserved"),
    Row("loan from a parent that lends nothing", reserved, lambda L: L.lend("L1", 5), "lending_not_allowed",
        dict(available=80, lent=0)),
    Row("loan of a dimension without a limit", lambda L: (L.tick(T0), L.open_parent(gpus=4, lending_limit={"tokens": 40})),
        lambda L: L.lend("L1", tokens=5, gpus=1), "lending_not_allowed", dict(available=100, lent=0)),
    Row("loan beyond the limit", lent, lambda L: L.lend("L3", 6), "exceeds_lending_limit",
        dict(available=45, lent=35)),
    Row("loan up to the limit", lent, lambda L: L.lend("L3", 5), "ok", dict(available=40, lent=40)),
    Row("loan beyond available", lambda L: (lending(L), L.reserve("B", tokens=70)), lambda L: L.lend("L1", 20),
        "exceeds_available", dict(available=10, outstanding=90, lent=0)),
    Row("loan beyond both the limit and available: the limit first",
        lambda L: (lending(L), L.reserve("B", tokens=70)), lambda L: L.lend("L1", 41), "exceeds_lending_limit",
        dict(available=10, lent=0)),
    Row("loan of a dimension the parent lacks", lending,
        lambda L: L.send("LoanRequested", key="P/loan/L1/request", loan_id="L1", borrower="b",
                         quantities={"cpu": 1}), "invalid_event", dict(available=80, lent=0)),
    Row("loan of nothing", lending, lambda L: L.lend("L1", 0), "invalid_event", dict(available=80, lent=0)),
    Row("loan under another key", lending,
        lambda L: L.send("LoanRequested", key="P/L1", loan_id="L1", borrower="b", quantities={"tokens": 1}),
        "invalid_event", dict(available=80, lent=0)),
    Row("loan redelivered", lent, lambda L: L.lend("L1", 20), "duplicate", dict(available=45, lent=35)),
    Row("loan id reused with another payload", lent, lambda L: L.lend("L1", 5), "idempotency_conflict",
        dict(available=45, lent=35)),
    Row("loan of an unknown parent", lambda L: L.tick(T0), lambda L: L.lend("L1", 5), "unknown_parent", {}),
    Row("loan while a loan is recalled for a sibling", recalled, lambda L: L.lend("L3", 5),
        "awaiting_revocation", dict(available=45, lent=35)),
    Row("loan on a closing parent", lent_closing, lambda L: L.lend("L3", 1), "parent_closed",
        dict(available=0, lent=35, returned_to_pool=45)),
    Row("loan on an expired parent", lambda L: (lent(L), L.tick(T0 + 3_600_001)), lambda L: L.lend("L3", 1),
        "parent_closed", dict(available=0, lent=35)),
    # ChildReserved against lent capacity
    Row("sibling covered by available and lent: revocation", lent, lambda L: L.reserve("B", tokens=50),
        "awaiting_revocation", dict(available=45, outstanding=20, lent=35)),
    Row("sibling beyond available and lent", lent, lambda L: L.reserve("B", tokens=81), "exceeds_available",
        dict(available=45, lent=35)),
    Row("sibling within available while loans are out", lent, lambda L: L.reserve("B", tokens=45), "ok",
        dict(available=0, outstanding=65, lent=35)),
    Row("sibling retried after the loan came back", lambda L: (recalled(L), L.return_loan("L2", tokens=0)),
        lambda L: L.reserve("B", tokens=50), "ok", dict(available=10, outstanding=70, lent=20)),
    # LoanReturned
    Row("loan returned unused", lent, lambda L: L.return_loan("L2"), "ok",
        dict(available=60, lent=20, committed=0)),
    Row("loan returned with usage", lent, lambda L: L.return_loan("L2", tokens=5), "ok",
        dict(available=55, lent=20, committed=5)),
    Row("loan returned fully used", lent, lambda L: L.return_loan("L2", tokens=15), "ok",
        dict(available=45, lent=20, committed=15)),
    Row("loan overrun drawn from available", lent, lambda L: L.return_loan("L2", tokens=25), "ok",
        dict(available=35, lent=20, committed=25, overdrawn=0)),
    Row("loan overrun beyond the parent", lambda L: (lent(L), L.reserve("B", tokens=45)),
        lambda L: L.return_loan("L2", tokens=18), "overdrawn",
        dict(available=0, lent=20, committed=18, overdrawn=3)),
    Row("loan returned twice", lambda L: (lent(L), L.return_loan("L2", tokens=5)),
        lambda L: L.return_loan("L2", tokens=5), "duplicate", dict(available=55, lent=20, committed=5)),
    Row("loan returned again with other usage", lambda L: (lent(L), L.return_loan("L2", tokens=5)),
        lambda L: L.return_loan("L2", tokens=1), "idempotency_conflict", dict(available=55, lent=20, committed=5)),
    Row("unknown loan returned", lent, lambda L: L.return_loan("L9"), "unknown_loan", dict(available=45, lent=35)),
    Row("return of a loan that was refused", lambda L: (lending(L), L.lend("L1", 41)),
        lambda L: L.return_loan("L1"), "unknown_loan", dict(available=80, lent=0)),
    Row("loan returned naming a dimension the parent lacks", lent,
        lambda L: L.send("LoanReturned", key="P/loan/L1/return", loan_id="L1", usage={"cpu": 1}), "invalid_event",
        dict(available=45, lent=35)),
    Row("loan returned on a closing parent: the remainder to the pool", lent_closing,
        lambda L: L.return_loan("L1", tokens=5), "ok",
        dict(available=0, outstanding=20, lent=15, committed=5, returned_to_pool=60)),
    Row("last loan returned on a closing parent: it closes", lambda L: (
        lent_closing(L), complete(L, 20), L.return_loan("L1", tokens=5)),
        lambda L: L.return_loan("L2"), "ok",
        dict(available=0, outstanding=0, lent=0, committed=25, returned_to_pool=75)),
    Row("loan returned to a closed parent", lambda L: (
        lent_closing(L), complete(L, 20), L.return_loan("L1"), L.return_loan("L2")),
        lambda L: L.send("LoanReturned", key="P/loan/L3/return", loan_id="L3", usage={}), "parent_closed",
        dict(lent=0, committed=20, returned_to_pool=80)),
    # ParentClosed and parent expiry with loans out
    Row("parent closed with loans out stays closing", lambda L: (lent(L), L.activate("A")),
        lambda L: L.send("ParentClosed", outcome="succeeded"), "ok",
        dict(available=0, outstanding=20, lent=35, returned_to_pool=45), "activated"),
    Row("parent lease expiry with loans out", lent, lambda L: L.tick(T0 + 3_600_001), "ok",
        dict(available=0, outstanding=0, lent=35, returned_to_pool=65), "released"),
    # Tick
    Row("tick advances time", fresh, lambda L: L.tick(T0 + 1), "ok", dict(available=100)),
    Row("tick behind ledger time", fresh, lambda L: L.tick(T0 - 1), "stale_tick", dict(available=100)),
    Row("lease expiry moves the remainder to pending", activated, lambda L: L.tick(LEASE_END), "ok",
        dict(available=80, outstanding=0, pending=20), "reconciling"),
    Row("reconciliation timeout strands", reconciling, lambda L: L.tick(RECON_END), "ok",
        dict(pending=20, available=80), "stranded"),
    Row("a reserved child has no lease to expire", reserved, lambda L: L.tick(LEASE_END), "ok",
        dict(outstanding=20), "reserved"),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_transition(row: Row) -> None:
    L = Ledger()
    row.setup(L)
    assert row.act(L) == row.result, L.out.results[-1]["detail"]
    if row.balance:
        balance = L.balance()
        assert {k: balance[k] for k in row.balance} == row.balance
    if row.state is not None:
        assert L.state("A") == row.state
