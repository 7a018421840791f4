"""The ledger's state records, as plain dicts shaped like their Avro schemas (schemas/Ledger*.avsc).

Plain dicts keep the fold fast and make a record's changelog encoding a direct write of the same object.
Every constructor here returns a record with every field present, so two ledgers built by the same events
compare equal and encode to the same bytes.
"""

from __future__ import annotations

# Parent status (SPEC §2): open -> closing -> closed, or open -> expired -> closed.
PARENT_OPEN = "open"
PARENT_CLOSING = "closing"
PARENT_EXPIRED = "expired"
PARENT_CLOSED = "closed"
PARENT_FENCED = frozenset({PARENT_CLOSING, PARENT_EXPIRED, PARENT_CLOSED})

# Child states (SPEC §5).
RESERVED = "reserved"
ACTIVATED = "activated"
PARTIALLY_CONSUMED = "partially_consumed"
CANCEL_REQUESTED = "cancel_requested"
EXPIRED = "expired"
RECONCILING = "reconciling"
STRANDED = "stranded"
COMMITTED = "committed"
RELEASED = "released"

# Where a child's unconsumed remainder is counted: live children in `outstanding`, children in
# reconciliation in `pending`; settled children hold nothing.
LIVE_STATES = frozenset({RESERVED, ACTIVATED, PARTIALLY_CONSUMED, CANCEL_REQUESTED})
PENDING_STATES = frozenset({EXPIRED, RECONCILING, STRANDED})
SETTLED_STATES = frozenset({COMMITTED, RELEASED})

LOGICAL = "logical"
PHYSICAL = "physical"
DIMENSION_KINDS = frozenset({LOGICAL, PHYSICAL})

# The balance terms of SPEC §3, in the order the ledger JSON prints them.
BALANCE_TERMS = (
    "capacity",
    "available",
    "outstanding",
    "pending",
    "awaiting_confirmation",
    "lent",
    "returned_to_pool",
    "committed",
    "overdrawn",
)
# The left-hand side of the invariant: every term but capacity and overdrawn, which are its right-hand side.
HELD_TERMS = tuple(term for term in BALANCE_TERMS if term not in ("capacity", "overdrawn"))

DESTINATION_PARENT = "parent"
DESTINATION_POOL = "global_pool"

# Loan states (explicit borrowing): a loan holds its quantities in `lent` while open.
LOAN_OPEN = "open"
LOAN_RETURNED = "returned"
# Audit-record states of a loan (a loan's records name no child: their states tell them apart).
AUDIT_LOAN_OPEN = "loan_open"
AUDIT_LOAN_RETURNED = "loan_returned"
# The reason of a release of what a borrower did not use of its loan.
RELEASE_LOAN_RETURNED = "loan_returned"
LOAN_AUDIT_STATES = frozenset({AUDIT_LOAN_OPEN, AUDIT_LOAN_RETURNED})


def is_loan_audit(audit: dict) -> bool:
    """Whether an audit record is a loan's (it names no child; its states are a loan's, not the parent's)."""
    return not audit["child_id"] and audit["new_state"] in LOAN_AUDIT_STATES

# Timer kinds: what a tick passing the deadline does.
TIMER_CHILD_LEASE = "child_lease"
TIMER_RECONCILIATION = "reconciliation"
TIMER_PARENT_LEASE = "parent_lease"
# A closed parent's retention ended: it is compacted (its children, idempotency records and timers deleted, the
# parent record cut down to a tombstone).
TIMER_PARENT_RETENTION = "parent_retention"

# How long, in ledger time, a closed parent keeps its children and idempotency records (so that a redelivery
# still gets `duplicate` and the ledger JSON still shows them) before it is compacted to a tombstone (SPEC §8:
# late events then get `parent_closed`). A constant of the ledger's contract, like its other rules, not a setting
# of the processor: a replay runs the same fold, so it compacts at the same ledger times (docs/decisions.md,
# decision 22). None: never compacted (the benchmarks' comparison).
CLOSED_PARENT_RETENTION_MS: int | None = 7 * 24 * 3600 * 1000


def new_balance(kind: str, capacity: int) -> dict:
    return {
        "kind": kind,
        "capacity": capacity,
        "available": capacity,
        "outstanding": 0,
        "pending": 0,
        "awaiting_confirmation": 0,
        "lent": 0,
        "returned_to_pool": 0,
        "committed": 0,
        "overdrawn": 0,
    }


def new_parent(parent_id: str, capacity: dict, lease_expires_at_ms: int, policy: dict) -> dict:
    return {
        "parent_id": parent_id,
        "status": PARENT_OPEN,
        "outcome": None,
        "lease_expires_at_ms": lease_expires_at_ms,
        "max_live_children": policy["max_live_children"],
        "reconciliation_timeout_ms": policy["reconciliation_timeout_ms"],
        "lending_limit": dict(sorted(policy["lending_limit"].items())),
        "live_children": 0,
        "open_children": 0,
        "children": [],
        "winners": {},
        "dimensions": {
            dim: new_balance(spec["kind"], spec["quantity"]) for dim, spec in sorted(capacity.items())
        },
        "loans": [],
        "closed_at_ms": None,
        "compacted_at_ms": None,
    }


def is_compacted(parent: dict) -> bool:
    return parent.get("compacted_at_ms") is not None


def new_loan(loan_id: str, borrower: str, quantities: dict, lent_at_ms: int) -> dict:
    return {
        "loan_id": loan_id,
        "borrower": borrower,
        "quantities": dict(sorted(quantities.items())),
        "state": LOAN_OPEN,
        "revocation_requested": False,
        "usage": {},
        "lent_at_ms": lent_at_ms,
    }


def open_loans(parent: dict) -> list[dict]:
    """The parent's loans not yet returned, oldest first."""
    return [loan for loan in parent["loans"] if loan["state"] == LOAN_OPEN]


def lent_by_loans(parent: dict) -> dict[str, int]:
    """Per dimension, what the parent's open loans hold: the `lent` term recomputed (the ledger auditor)."""
    lent = {dim: 0 for dim in parent["dimensions"]}
    for loan in open_loans(parent):
        for dim, quantity in loan["quantities"].items():
            lent[dim] = lent.get(dim, 0) + quantity
    return lent


def loan_usage(parent: dict) -> dict[str, int]:
    """Per dimension, what borrowers consumed of the parent's returned loans (part of `committed`)."""
    used: dict[str, int] = {}
    for loan in parent["loans"]:
        for dim, quantity in loan["usage"].items():
            used[dim] = used.get(dim, 0) + quantity
    return used


def new_child(parent_id: str, child_id: str, branch_id: str, attempt_id: str, quantities: dict) -> dict:
    reserved = dict(sorted(quantities.items()))
    return {
        "parent_id": parent_id,
        "child_id": child_id,
        "branch_id": branch_id,
        "attempt_id": attempt_id,
        "state": RESERVED,
        "activated": False,
        "lease_generation": 0,
        "lease_expires_at_ms": None,
        "reconcile_deadline_ms": None,
        "reserved": reserved,
        "consumed": {dim: 0 for dim in reserved},
        "earlier_attempts_consumed": {},
        "awaiting": {},
        "awaiting_destination": {},
        "escalated": {},
        "usage_report_ids": [],
    }


def balance_terms(parent: dict) -> dict[tuple[str, str], int]:
    """The parent's balance, term by term: (term, dimension) -> quantity, for every term but the kind."""
    return {(term, dim): value for dim, balance in parent["dimensions"].items()
            for term, value in balance.items() if term != "kind"}


def remainder(child: dict, dim: str) -> int:
    """Reserved but not consumed: what the child still holds of `dim` (never negative)."""
    left = child["reserved"].get(dim, 0) - child["consumed"].get(dim, 0)
    return left if left > 0 else 0


def consumed_by_all_attempts(child: dict) -> dict[str, int]:
    """What every attempt of the child consumed: the holder's `consumed` and what the attempts that handed it to a
    retry had (`earlier_attempts_consumed`)."""
    earlier = child["earlier_attempts_consumed"]
    consumed = child["consumed"]
    return {dim: consumed.get(dim, 0) + earlier.get(dim, 0) for dim in consumed.keys() | earlier.keys()}


def holding_term(state: str) -> str | None:
    """The balance term in which a child in `state` holds its remainder."""
    if state in LIVE_STATES:
        return "outstanding"
    if state in PENDING_STATES:
        return "pending"
    return None


def new_meta() -> dict:
    return {"ledger_time_ms": 0, "last_tick_key": None}


def held_by_children(parent: dict, children: list[dict]) -> dict[str, dict[str, int]]:
    """Per dimension, the balance terms that the children's states alone determine: `outstanding` (the
    remainders of live children), `pending` (of children in reconciliation) and `awaiting_confirmation`
    (released physical remainders the scheduler has not confirmed free). The fold keeps these terms as running
    sums; the ledger auditor and an invariant violation's description recompute them from here."""
    held = {dim: {"outstanding": 0, "pending": 0, "awaiting_confirmation": 0} for dim in parent["dimensions"]}
    for child in children:
        term = holding_term(child["state"])
        for dim, terms in held.items():
            if term is not None:
                terms[term] += remainder(child, dim)
            terms["awaiting_confirmation"] += child["awaiting"].get(dim, 0)
    return held
