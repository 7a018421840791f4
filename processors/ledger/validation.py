"""Semantic validation of an event: what makes it meaningless (`invalid_event`), checked before anything else.
The codec has checked the types and the record's size; this checks the values against the ranges of
schemas/limits.py, so every sum the fold computes stays far inside int64 and every record it writes fits a
topic's message size.

`validate` answers most events with a few C-level calls (`_plainly_valid`) and gives the rest to the full
check (`_problem`), which also says what is wrong; both accept exactly the same events
(tests/ledger/test_fold_perf_equivalence.py holds them to it).
"""

from __future__ import annotations

import operator

from branch_settlement.projections import model
from branch_settlement.schemas.limits import (MAX_CHILDREN_PER_PARENT, MAX_DIMENSIONS, MAX_ID_BYTES,
                                              MAX_KEY_BYTES, MAX_LEASE_GENERATION, MAX_QUANTITY, MAX_TIME_MS,
                                              MAX_TTL_MS)

# The ids an event of each type names besides event_id, idempotency_key and parent_id.
ID_FIELDS = {
    "ParentReserved": (),
    "ChildReserved": ("child_id", "branch_id", "attempt_id"),
    "ChildActivated": ("child_id", "attempt_id"),
    "LeaseRenewed": ("child_id", "attempt_id"),
    "UsageReported": ("child_id", "attempt_id", "usage_report_id"),
    "ChildCompleted": ("child_id", "attempt_id"),
    "ChildSkipped": ("child_id", "attempt_id"),
    "CancelRequested": ("child_id", "attempt_id"),
    "CancelAcknowledged": ("child_id", "attempt_id"),
    "ChildFailed": ("child_id", "attempt_id"),
    "SpeculativeWinner": ("branch_id", "winner_attempt_id"),
    "ReservationTransferred": ("child_id", "from_attempt_id", "to_attempt_id"),
    "ReconciliationResolved": ("child_id", "attempt_id"),
    "UsageAdjustment": ("child_id", "attempt_id"),
    "SchedulerReleaseConfirmed": ("child_id", "attempt_id", "dimension"),
    "ParentClosed": (),
    "Tick": (),
    "LoanRequested": ("loan_id", "borrower"),
    "LoanReturned": ("loan_id",),
}
LOAN_EVENTS = {"LoanRequested": "request", "LoanReturned": "return"}
QUANTITY_FIELDS = ("quantities", "usage")
TTL_FIELDS = ("lease_ttl_ms",)
PARENT_OUTCOMES = frozenset({"succeeded", "failed", "cancelled"})
OUTCOME_EVENTS = frozenset({"CancelAcknowledged", "ChildFailed"})
RESOLUTIONS = frozenset({"late_report", "operator"})


def _utf8_size(value: str) -> int:
    # surrogatepass: the codec refuses lone surrogates; here they only need a size
    return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))


def _bad_id(value, limit: int = MAX_ID_BYTES) -> bool:
    return type(value) is not str or not value or "\x00" in value or _utf8_size(value) > limit


def _id_problem(field: str, limit: int = MAX_ID_BYTES) -> str:
    return f"{field} must be non-empty, contain no NUL and take at most {limit} bytes of UTF-8"


def _bad_quantities(quantities) -> str | None:
    if len(quantities) > MAX_DIMENSIONS:
        return f"{len(quantities)} dimensions, at most {MAX_DIMENSIONS}"
    for dim, quantity in quantities.items():
        if _bad_id(dim):
            return f"dimension name {dim[:40]!r}: {_id_problem('a dimension name')}"
        if type(quantity) is not int or not 0 <= quantity <= MAX_QUANTITY:
            return f"{dim}: quantity must be an integer from 0 to {MAX_QUANTITY}, got {quantity!r}"
    return None


def validate(event: dict) -> str | None:
    """What makes the event meaningless, or None. Types were checked by the codec; this checks values."""
    try:
        if _plainly_valid(event):
            return None
    except Exception:  # raised again, or not, by the full check below
        pass
    return _problem(event)


# The ids every event of a type must have, fetched in one call (Tick and ParentReserved take the full check).
_IDS = {etype: operator.itemgetter("event_id", "parent_id", *fields)
        for etype, fields in ID_FIELDS.items() if etype not in ("Tick", "ParentReserved")}


def _plainly_valid(event: dict) -> bool:
    """True only where `_problem` finds nothing, checked with fewer calls; False means: ask `_problem`."""
    etype = event["type"]
    ids = _IDS.get(etype)
    if ids is None:
        return False
    for value in ids(event):
        if type(value) is not str or not value or len(value) > MAX_ID_BYTES or not value.isascii() or "\x00" in value:
            return False
    key = event["idempotency_key"]
    if type(key) is not str or not key or len(key) > MAX_KEY_BYTES or not key.isascii() or "\x00" in key:
        return False
    for field in QUANTITY_FIELDS:
        quantities = event.get(field)
        if quantities:
            if len(quantities) > MAX_DIMENSIONS:
                return False
            for dim, quantity in quantities.items():
                if type(dim) is not str or not dim or len(dim) > MAX_ID_BYTES or not dim.isascii() or "\x00" in dim \
                        or type(quantity) is not int or not 0 <= quantity <= MAX_QUANTITY:
                    return False
    for field in TTL_FIELDS:
        if field in event and not 0 < event[field] <= MAX_TTL_MS:
            return False
    if not 0 <= event.get("lease_generation", 0) <= MAX_LEASE_GENERATION:
        return False
    if "/loan/" in key and etype not in LOAN_EVENTS and _has_a_loans_key(event):
        return False
    if etype == "ChildReserved":
        return bool(event["quantities"])
    if etype == "ParentClosed":
        return event["outcome"] in PARENT_OUTCOMES
    if etype == "ReconciliationResolved":
        return event["resolution"] in RESOLUTIONS
    if etype in OUTCOME_EVENTS:
        return _outcome_problem(event) is None
    if etype in LOAN_EVENTS:
        return _loan_problem(event) is None
    return True


def _problem(event: dict) -> str | None:
    etype = event["type"]
    if etype not in ID_FIELDS:
        return f"unknown event type {etype!r}"
    if _bad_id(event["event_id"]):
        return _id_problem("event_id")
    if _bad_id(event["idempotency_key"], MAX_KEY_BYTES):
        return _id_problem("idempotency_key", MAX_KEY_BYTES)
    if etype == "Tick":
        if event["parent_id"]:
            return "a Tick belongs to a partition: parent_id must be empty"
        return None if 0 <= event["now_ms"] <= MAX_TIME_MS else f"now_ms must be from 0 to {MAX_TIME_MS}"
    if _bad_id(event["parent_id"]):
        return _id_problem("parent_id")
    for field in ID_FIELDS[etype]:
        if _bad_id(event[field]):
            return _id_problem(field)
    for field in QUANTITY_FIELDS:
        quantities = event.get(field)
        if quantities:
            problem = _bad_quantities(quantities)
            if problem:
                return f"{field}: {problem}"
    for field in TTL_FIELDS:
        if field in event and not 0 < event[field] <= MAX_TTL_MS:
            return f"{field} must be from 1 to {MAX_TTL_MS}"
    if not 0 <= event.get("lease_generation", 0) <= MAX_LEASE_GENERATION:
        return f"lease_generation must be from 0 to {MAX_LEASE_GENERATION}"
    if etype == "ParentReserved":
        return _validate_parent_reserved(event)
    if etype == "ChildReserved" and not event["quantities"]:
        return "quantities must name at least one dimension"
    if etype == "ParentClosed" and event["outcome"] not in PARENT_OUTCOMES:
        return f"outcome must be one of {sorted(PARENT_OUTCOMES)}"
    if etype == "ReconciliationResolved" and event["resolution"] not in RESOLUTIONS:
        return f"resolution must be one of {sorted(RESOLUTIONS)}"
    if etype in OUTCOME_EVENTS:
        return _outcome_problem(event)
    if etype in LOAN_EVENTS:
        return _loan_problem(event)
    if _has_a_loans_key(event):
        return "idempotency_key: <parent_id>/loan/<loan_id>/request and .../return are the loans' own keys"
    return None


def _has_a_loans_key(event: dict) -> bool:
    """Whether an event that is not a loan's takes the form of a loan's key: stored under it, it would make that
    loan's own event an idempotency_conflict forever (its capacity stuck in `lent`, the parent never closed)."""
    key = event["idempotency_key"]
    return key.startswith(f"{event['parent_id']}/loan/") and key.endswith(_LOAN_KEY_ENDS)


_LOAN_KEY_ENDS = tuple(f"/{v}" for v in LOAN_EVENTS.values())


def _loan_problem(event: dict) -> str | None:
    """A loan's events carry the loan's own idempotency keys, so a second request or return of one loan is always
    a `duplicate` or an `idempotency_conflict`; a loan lends something."""
    expected = f"{event['parent_id']}/loan/{event['loan_id']}/{LOAN_EVENTS[event['type']]}"
    if event["idempotency_key"] != expected:
        return f"idempotency_key must be {expected[:MAX_KEY_BYTES]!r}"
    if event["type"] == "LoanRequested" and not any(q > 0 for q in event["quantities"].values()):
        return "quantities must lend more than 0 of at least one dimension"
    return None


def _outcome_problem(event: dict) -> str | None:
    """A CancelAcknowledged or ChildFailed reports its usage as known (a total) or uncertain, never both; a
    retry keeps the capacity only with known usage, and only for another attempt."""
    uncertain, usage = event["usage_uncertain"], event["usage"]
    if uncertain and usage is not None:
        return "usage and usage_uncertain are exclusive"
    if not uncertain and usage is None:
        if event["type"] == "CancelAcknowledged":
            return "a cancel acknowledgement needs usage or usage_uncertain"
        if event["activated"]:
            return "a failure after activation needs usage or usage_uncertain"
    retry = event.get("retry_attempt_id")  # absent or empty: no retry keeps the capacity
    if retry and uncertain:
        return "a retry can keep the capacity only when the usage is known"
    if retry and _bad_id(retry):
        return _id_problem("retry_attempt_id")
    if retry == event["attempt_id"]:
        return "retry_attempt_id names the failing attempt itself"
    return None


def _validate_parent_reserved(event: dict) -> str | None:
    capacity = event["capacity"]
    if not capacity:
        return "capacity must name at least one dimension"
    problem = _bad_quantities({dim: spec["quantity"] for dim, spec in capacity.items()})
    if problem:
        return f"capacity: {problem}"
    for dim, spec in capacity.items():
        if spec["kind"] not in model.DIMENSION_KINDS:
            return f"capacity.{dim}.kind must be logical or physical, got {spec['kind']!r}"
    policy = event["policy"]
    if not 1 <= policy["max_live_children"] <= MAX_CHILDREN_PER_PARENT:
        return f"policy.max_live_children must be from 1 to {MAX_CHILDREN_PER_PARENT}"
    if not 0 < policy["reconciliation_timeout_ms"] <= MAX_TTL_MS:
        return f"policy.reconciliation_timeout_ms must be from 1 to {MAX_TTL_MS}"
    problem = _bad_quantities(policy["lending_limit"])
    return f"policy.lending_limit: {problem}" if problem else None
