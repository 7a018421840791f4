"""The fold: `Fold.apply(event, offset, out)` applies one event to the ledger and appends its outputs.

Pure in the sense that matters: no I/O of its own (it reads and writes a LedgerView, which buffers), no
clock (ledger time comes from Tick events), no randomness, and iteration orders are fixed, so the same
events in the same order give the same ledger and the same outputs, byte for byte.

Per event, in order:
1. semantic validation (ids, quantities, TTLs, enumerations) -> `invalid_event`, nothing changes;
2. idempotency: a stored result under the same key -> `duplicate` (same payload) or
   `idempotency_conflict` (another payload), nothing changes;
3. the handler decides (a rejection code, nothing changes) or applies;
4. the accounting invariant is checked on every parent the event changed; a violation raises
   InvariantViolation, which stops the partition;
5. exactly one result is emitted; an applied event's result is stored under its idempotency key.
"""

from __future__ import annotations

import hashlib
import json
import operator

from branch_settlement.processors.ledger import results
from branch_settlement.processors.ledger.context import EventContext
from branch_settlement.processors.ledger.errors import InvariantViolation
from branch_settlement.processors.ledger.handlers import HANDLERS, Reject, fire_timer, rebase_timers
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.projections import model
from branch_settlement.projections.view import LedgerView
from branch_settlement.schemas.codec import EVENT_TYPES, default_codec
from branch_settlement.schemas.event_json import compile_sorted_json

# Fields that describe a delivery, not the settlement: left out of the payload comparison (SPEC §10).
DELIVERY_FIELDS = ("event_id", "occurred_at_ms")

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
}
QUANTITY_FIELDS = ("quantities", "usage")
TTL_FIELDS = ("lease_ttl_ms",)
PARENT_OUTCOMES = frozenset({"succeeded", "failed", "cancelled"})
OUTCOME_EVENTS = frozenset({"CancelAcknowledged", "ChildFailed"})
RESOLUTIONS = frozenset({"late_report", "operator"})


# The payload's canonical form: JSON with keys sorted at every level, so equal payloads give equal bytes
# whatever their key order. Stored digests were made with exactly these options: changing them would turn
# every redelivery of an event applied before the change into an `idempotency_conflict`. Made once, because
# json.dumps with options builds a new encoder per call; no cycle check, since a decoded event is a tree.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, check_circular=False)


def _canonical_json(event: dict) -> str:
    payload = dict(event)
    for field in DELIVERY_FIELDS:
        payload.pop(field, None)
    return _CANONICAL_JSON.encode(payload)


def _sorted_json_writers() -> dict:
    """Per event type, the same text as `_canonical_json` written by a function generated from the event's
    schema (schemas/event_json.py), or None where it is not sure (then `_canonical_json` writes it)."""
    codec = default_codec()
    return {name: compile_sorted_json(name, codec.version(name).parsed, DELIVERY_FIELDS) for name in EVENT_TYPES}


_SORTED_JSON = _sorted_json_writers()
_blake2b = hashlib.blake2b


def payload_digest(event: dict) -> bytes:
    try:
        data = _SORTED_JSON[event["type"]](event)
    except Exception:  # not an event of a known type: json.dumps below says what it is
        data = None
    if data is None:
        data = _canonical_json(event).encode()
    return _blake2b(data, digest_size=16).digest()


def _bad_id(value) -> bool:
    return type(value) is not str or not value or "\x00" in value


def _bad_quantities(quantities) -> str | None:
    for dim, quantity in quantities.items():
        if _bad_id(dim):
            return f"dimension name {dim!r} is empty or contains NUL"
        if type(quantity) is not int or quantity < 0:
            return f"{dim}: quantity must be a non-negative integer, got {quantity!r}"
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
_IDS = {etype: operator.itemgetter("event_id", "idempotency_key", "parent_id", *fields)
        for etype, fields in ID_FIELDS.items() if etype not in ("Tick", "ParentReserved")}


def _plainly_valid(event: dict) -> bool:
    """True only where `_problem` finds nothing, checked with fewer calls; False means: ask `_problem`."""
    etype = event["type"]
    ids = _IDS.get(etype)
    if ids is None:
        return False
    for value in ids(event):
        if type(value) is not str or not value or "\x00" in value:
            return False
    for field in QUANTITY_FIELDS:
        quantities = event.get(field)
        if quantities:
            for dim, quantity in quantities.items():
                if type(dim) is not str or not dim or "\x00" in dim or type(quantity) is not int or quantity < 0:
                    return False
    for field in TTL_FIELDS:
        if field in event and event[field] <= 0:
            return False
    if event.get("lease_generation", 0) < 0:
        return False
    if etype == "ChildReserved":
        return bool(event["quantities"])
    if etype == "ParentClosed":
        return event["outcome"] in PARENT_OUTCOMES
    if etype == "ReconciliationResolved":
        return event["resolution"] in RESOLUTIONS
    if etype in OUTCOME_EVENTS:
        return _outcome_problem(event) is None
    return True


def _problem(event: dict) -> str | None:
    etype = event["type"]
    if etype not in ID_FIELDS:
        return f"unknown event type {etype!r}"
    if _bad_id(event["event_id"]) or _bad_id(event["idempotency_key"]):
        return "event_id and idempotency_key must be non-empty and contain no NUL"
    if etype == "Tick":
        if event["parent_id"]:
            return "a Tick belongs to a partition: parent_id must be empty"
        return None if event["now_ms"] >= 0 else "now_ms must be >= 0"
    if _bad_id(event["parent_id"]):
        return "parent_id must be non-empty and contain no NUL"
    for field in ID_FIELDS[etype]:
        if _bad_id(event[field]):
            return f"{field} must be non-empty and contain no NUL"
    for field in QUANTITY_FIELDS:
        quantities = event.get(field)
        if quantities:
            problem = _bad_quantities(quantities)
            if problem:
                return f"{field}: {problem}"
    for field in TTL_FIELDS:
        if field in event and event[field] <= 0:
            return f"{field} must be > 0"
    if event.get("lease_generation", 0) < 0:
        return "lease_generation must be >= 0"
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
    retry = event.get("retry_attempt_id")
    if retry is not None and uncertain:
        return "a retry can keep the capacity only when the usage is known"
    if retry is not None and (not retry or "\x00" in retry):
        return "retry_attempt_id must be non-empty and contain no NUL"
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
    if policy["max_live_children"] < 1:
        return "policy.max_live_children must be >= 1"
    if policy["reconciliation_timeout_ms"] <= 0:
        return "policy.reconciliation_timeout_ms must be > 0"
    problem = _bad_quantities(policy["lending_limit"])
    return f"policy.lending_limit: {problem}" if problem else None


# The invariant runs after every applied event on every parent it touched: each balance's terms are fetched in
# one C-level call, and checked with min and sum (the held terms add up to capacity + overdrawn exactly when all
# nine add up to twice that); a term is looked at by name only to describe a violation.
_balance_terms = operator.itemgetter(*model.BALANCE_TERMS)
_held_terms = operator.itemgetter(*model.HELD_TERMS)
_CAPACITY = model.BALANCE_TERMS.index("capacity")
_OVERDRAWN = model.BALANCE_TERMS.index("overdrawn")


def check_invariant(parent: dict, ctx: EventContext, view: LedgerView) -> None:
    live = parent["live_children"]
    if 0 <= live <= parent["open_children"]:
        for balance in parent["dimensions"].values():
            terms = _balance_terms(balance)
            if min(terms) < 0 or sum(terms) != 2 * (terms[_CAPACITY] + terms[_OVERDRAWN]):
                break
        else:
            return
    _raise_violation(parent, ctx, view)


def _raise_violation(parent: dict, ctx: EventContext, view: LedgerView) -> None:
    """The first violation of the parent, described with what its children say the terms should be."""
    parent_id = parent["parent_id"]
    event_id, offset = ctx.event["event_id"], ctx.offset
    diagnosis = describe_children(parent, ctx, view)
    if not 0 <= parent["live_children"] <= parent["open_children"]:
        raise InvariantViolation(parent_id, "*", f"live_children = {parent['live_children']}, "
                                                 f"open_children = {parent['open_children']}", event_id, offset,
                                 diagnosis)
    for dim, balance in parent["dimensions"].items():
        if min(_balance_terms(balance)) < 0:
            term = next(term for term in model.BALANCE_TERMS if balance[term] < 0)
            raise InvariantViolation(parent_id, dim, f"{term} = {balance[term]} < 0", event_id, offset, diagnosis)
        held = sum(_held_terms(balance))
        if held != balance["capacity"] + balance["overdrawn"]:
            raise InvariantViolation(
                parent_id, dim, f"terms add up to {held}, capacity + overdrawn = "
                                f"{balance['capacity'] + balance['overdrawn']}: {balance}", event_id, offset,
                diagnosis)


def _holds(child: dict) -> str:
    term = model.holding_term(child["state"])
    if term is None:
        return "holds nothing"
    return f"holds {dict((dim, model.remainder(child, dim)) for dim in child['reserved'])} in {term}"


def describe_children(parent: dict, ctx: EventContext, view: LedgerView) -> str:
    """The ledger auditor's view of a broken parent: each child-derived term that disagrees with its children
    (model.held_by_children), and the children this event changed, with their states and remainders: where a
    remainder sits in the wrong term, one of them moved it."""
    children = [view.child(parent["parent_id"], child_id) for child_id in parent["children"]]
    derived = model.held_by_children(parent, [child for child in children if child is not None])
    wrong = [f"{dim}.{term} = {parent['dimensions'][dim][term]}, its children hold {quantity}"
             for dim, terms in derived.items() for term, quantity in terms.items()
             if parent["dimensions"][dim][term] != quantity]
    changed = [f"{child['child_id']} ({child['state']}, attempt {child['attempt_id']}, "
               + _holds(child) + ")"
               for child in ctx.touched_children.values() if child["parent_id"] == parent["parent_id"]]
    return (f"recomputed from the children: {'; '.join(wrong) or 'every child-derived term agrees'}; "
            f"children this event changed: {', '.join(changed) or 'none'}")


class Fold:
    """Applies events of one input partition to its ledger."""

    def __init__(self, view: LedgerView, partition: int = 0) -> None:
        self.view = view
        self.partition = partition

    def apply(self, event: dict, offset: int, out: Outputs) -> dict:
        """Apply one event; append its outputs to `out`; return its result record."""
        ctx = EventContext(event, self.partition, offset, self.view.meta["ledger_time_ms"], out)
        problem = validate(event)
        if problem is not None:
            code, detail = results.INVALID_EVENT, problem
        elif event["type"] == "Tick":
            code, detail = self._tick(ctx)
        else:
            code, detail = self._apply_once(ctx)
        for parent in ctx.touched.values():
            check_invariant(parent, ctx, self.view)
        result = {
            "event_id": event["event_id"],
            "idempotency_key": event["idempotency_key"],
            "parent_id": event["parent_id"],
            "child_id": event.get("child_id"),
            "event_type": event["type"],
            "result": code,
            "detail": detail,
            "input_partition": self.partition,
            "input_offset": offset,
            "ledger_time_ms": ctx.now_ms,
        }
        out.results.append(result)
        self.view.end_event()  # between events: the view may now trim its cache
        return result

    def _apply_once(self, ctx: EventContext) -> tuple[str, str]:
        event = ctx.event
        parent_id, key = event["parent_id"], event["idempotency_key"]
        digest = payload_digest(event)
        stored = self.view.idempotency(parent_id, key)
        if stored is not None:
            if stored["payload_digest"] == digest:
                return results.DUPLICATE, f"original event {stored['event_id']} had result {stored['result']}"
            return results.IDEMPOTENCY_CONFLICT, (f"key {key!r} was used by event {stored['event_id']} "
                                            f"({stored['event_type']}) with another payload")
        try:
            HANDLERS[event["type"]](ctx, self.view)
        except Reject as rejection:
            return rejection.code, rejection.detail
        code = results.OVERDRAWN if ctx.overdrawn else results.OK
        self.view.put_idempotency(parent_id, key, {
            "payload_digest": digest,
            "event_type": event["type"],
            "result": code,
            "event_id": event["event_id"],
        })
        return code, ""

    def _tick(self, ctx: EventContext) -> tuple[str, str]:
        event = ctx.event
        meta = self.view.meta
        now_ms = event["now_ms"]
        if now_ms <= meta["ledger_time_ms"]:
            if event["idempotency_key"] == meta["last_tick_key"]:
                return results.DUPLICATE, "this tick was already applied"
            return results.STALE_TICK, f"ledger time is already {meta['ledger_time_ms']}"
        first_tick = meta["last_tick_key"] is None
        meta["ledger_time_ms"] = now_ms
        meta["last_tick_key"] = event["idempotency_key"]
        self.view.put_meta()
        ctx.now_ms = now_ms
        if first_tick:
            rebase_timers(ctx, self.view, now_ms)
        marks, out = ctx.out.timer_marks, ctx.out
        for timer in self.view.pop_due_timers(now_ms):
            if marks is not None:
                marks.append((timer, len(out.releases), len(out.audits), len(out.settled)))
            fire_timer(ctx, self.view, *timer)
        return results.OK, ""
