"""One handler per event type (SPEC §4, §5, §8). Each first decides, raising `Reject` with a result code
and changing nothing, then applies through the steps of processors/ledger/accounting.py."""

from __future__ import annotations

from typing import Callable

from branch_settlement.processors.ledger import accounting
from branch_settlement.processors.ledger import results
from branch_settlement.processors.ledger.context import EventContext
from branch_settlement.projections import model
from branch_settlement.projections.view import LedgerView
from branch_settlement.schemas.limits import (MAX_BALANCE, MAX_CHILDREN_PER_PARENT, MAX_LOANS_PER_PARENT,
                                              MAX_USAGE_REPORTS_PER_ATTEMPT)


class Reject(Exception):
    """An expected rejection: becomes the event's result code. Raised before any change is made."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


# -- lookups shared by the handlers ---------------------------------------------------------------------


def _parent(ctx: EventContext, view: LedgerView, *, open_only: bool = False) -> dict:
    parent_id = ctx.event["parent_id"]
    parent = view.parent(parent_id)
    if parent is None:
        raise Reject(results.UNKNOWN_PARENT, f"no parent {parent_id!r}")
    if parent["status"] == model.PARENT_CLOSED:
        raise Reject(results.PARENT_CLOSED, _closed_detail(parent))
    if open_only and parent["status"] != model.PARENT_OPEN:
        raise Reject(results.PARENT_CLOSED, f"parent {parent_id!r} is {parent['status']}: new work is fenced")
    return parent


def _closed_detail(parent: dict) -> str:
    if model.is_compacted(parent):
        return (f"parent {parent['parent_id']!r} is closed and was compacted at ledger time "
                f"{parent['compacted_at_ms']}: its children and idempotency records are gone, so a redelivery "
                "cannot be told from a new event; nothing changes")
    return f"parent {parent['parent_id']!r} is closed"


def _child(view: LedgerView, parent: dict, child_id: str) -> dict:
    child = view.child(parent["parent_id"], child_id)
    if child is None:
        raise Reject(results.UNKNOWN_CHILD, f"no child {child_id!r} of parent {parent['parent_id']!r}")
    return child


def _check_dimensions(parent: dict, quantities: dict | None, field: str) -> None:
    if not quantities or quantities.keys() <= parent["dimensions"].keys():
        return
    unknown = sorted(set(quantities) - set(parent["dimensions"]))
    if unknown:
        raise Reject(results.INVALID_EVENT, f"{field} names dimensions the parent does not have: {', '.join(unknown)}")


def _escalate(ctx: EventContext, parent: dict, child: dict, code: str, detail: str) -> Reject:
    """A report that may not settle the child: its usage is kept as an escalation (an audit record per
    dimension), never committed silently."""
    usage = ctx.event.get("usage") or {}
    for dim in sorted(usage):
        ctx.audit(parent["parent_id"], child, child["state"], child["state"],
                  f"escalation ({code}): usage reported but not committed: {detail}", dim, usage[dim])
    if not usage:
        ctx.audit(parent["parent_id"], child, child["state"], child["state"], f"escalation ({code}): {detail}")
    return Reject(code, detail)


def _check_attempt(ctx: EventContext, parent: dict, child: dict, attempt_id: str) -> None:
    if attempt_id != child["attempt_id"]:
        raise _escalate(ctx, parent, child, results.SUPERSEDED_ATTEMPT,
                        f"attempt {attempt_id!r} does not hold child {child['child_id']!r} "
                        f"(held by {child['attempt_id']!r})")


def _held_child(ctx: EventContext, view: LedgerView, attempt_field: str = "attempt_id",
                usage_field: str | None = None) -> tuple[dict, dict]:
    """The checks every event about one child starts with, in SPEC §5's order: its parent (known, not
    closed), the child (known), the dimensions its usage names, the attempt that holds it, and that it is not
    settled yet. Returns (parent, child)."""
    event = ctx.event
    parent = _parent(ctx, view)
    child = _child(view, parent, event["child_id"])
    if usage_field is not None:
        _check_dimensions(parent, event.get(usage_field), usage_field)
    _check_attempt(ctx, parent, child, event[attempt_field])
    if child["state"] in model.SETTLED_STATES:
        raise Reject(results.ALREADY_SETTLED, f"child {child['child_id']!r} is {child['state']}")
    return parent, child


def _report_target(ctx: EventContext, view: LedgerView,
                   enters_reconciliation: Callable[[dict], bool] | None = None) -> tuple[dict, dict]:
    """Common checks of a usage or outcome report from an executor, in SPEC §5's order (parent, attempt,
    state, generation); returns (parent, child). `enters_reconciliation(child)` says whether the report
    would send the child to reconciliation, which a child already there refuses."""
    event = ctx.event
    parent, child = _held_child(ctx, view, usage_field="usage")
    state = child["state"]
    if state == model.STRANDED:
        raise _escalate(ctx, parent, child, results.INVALID_TRANSITION,
                        "child is stranded: only an operator's ReconciliationResolved settles it")
    if state in model.PENDING_STATES and enters_reconciliation is not None and enters_reconciliation(child):
        raise Reject(results.INVALID_TRANSITION, f"child is already in reconciliation ({state})")
    generation = event["lease_generation"]
    if generation < child["lease_generation"]:
        raise _escalate(ctx, parent, child, results.STALE_LEASE_GENERATION,
                        f"lease generation {generation} superseded by {child['lease_generation']}")
    if generation > child["lease_generation"] and state in model.PENDING_STATES:
        raise _escalate(ctx, parent, child, results.INVALID_TRANSITION,
                        f"lease generation {generation} is unknown to the ledger ({child['lease_generation']}) "
                        "and the child is in reconciliation")
    return parent, child


def _adopt_report(ctx: EventContext, view: LedgerView, parent: dict, child: dict, proves_execution: bool) -> None:
    """Take an out-of-order report at its word where it proves more than the state shows (SPEC §4)."""
    generation = ctx.event["lease_generation"]
    if generation > child["lease_generation"]:
        child["lease_generation"] = generation
        ctx.audit(parent["parent_id"], child, child["state"], child["state"], "implied lease renewal")
    if proves_execution and not child["activated"]:
        # Also in reconciliation: a report proves the attempt ran, so a later "never started" cannot release it.
        child["activated"] = True
        prior = child["state"]
        new_state = model.ACTIVATED if prior == model.RESERVED else prior
        accounting.set_state(ctx, view, parent, child, new_state, "implied activation")


def _check_headroom(parent: dict, usage: dict | None) -> None:
    """Committing `usage` (an upper bound of what the event commits) keeps every term it grows within
    MAX_BALANCE, far inside int64, so no sum the fold computes can overflow: `committed`, and `overdrawn` with
    every other term (they add up to capacity + overdrawn); a child's consumption is part of `committed`."""
    if not usage:
        return
    dims = parent["dimensions"]
    for dim, quantity in usage.items():
        balance = dims[dim]
        if max(balance["committed"], balance["capacity"] + balance["overdrawn"]) + quantity > MAX_BALANCE:
            raise Reject(results.LIMIT_EXCEEDED, f"{dim}: committing {quantity} would take the ledger past "
                                                 f"{MAX_BALANCE}")


def _known_usage(event: dict) -> dict | None:
    """The usage total of a CancelAcknowledged or ChildFailed: None when uncertain."""
    if event["usage_uncertain"]:
        return None
    return event["usage"] or {}


def _positive(usage: dict | None) -> bool:
    return any(q > 0 for q in (usage or {}).values())


# -- parents --------------------------------------------------------------------------------------------


def parent_reserved(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent_id = event["parent_id"]
    existing = view.parent(parent_id)
    if existing is not None:
        if existing["status"] == model.PARENT_CLOSED:
            raise Reject(results.PARENT_CLOSED, _closed_detail(existing))
        raise Reject(results.INVALID_TRANSITION, f"parent {parent_id!r} is already reserved")
    _check_dimensions({"dimensions": event["capacity"]}, event["policy"]["lending_limit"], "lending_limit")
    lease_expires_at_ms = ctx.now_ms + event["lease_ttl_ms"]
    parent = model.new_parent(parent_id, event["capacity"], lease_expires_at_ms, event["policy"])
    view.add_timer(lease_expires_at_ms, model.TIMER_PARENT_LEASE, parent_id)
    ctx.audit(parent_id, None, "", model.PARENT_OPEN, "parent reserved")
    accounting.touch(ctx, view, parent)


def parent_closed(ctx: EventContext, view: LedgerView) -> None:
    parent = _parent(ctx, view)
    prior = parent["status"]
    if prior == model.PARENT_CLOSING:
        raise Reject(results.INVALID_TRANSITION, f"parent {parent['parent_id']!r} is already closing")
    parent["outcome"] = ctx.event["outcome"]
    if prior == model.PARENT_OPEN:
        parent["status"] = model.PARENT_CLOSING
        ctx.audit(parent["parent_id"], None, prior, model.PARENT_CLOSING, f"parent closed: {parent['outcome']}")
        accounting.fence_parent(ctx, view, parent, "parent_closed")
    else:
        ctx.audit(parent["parent_id"], None, prior, prior, f"close recorded on expired parent: {parent['outcome']}")
    accounting.touch(ctx, view, parent)
    accounting.finish_parent_if_done(ctx, view, parent)


def expire_parent(ctx: EventContext, view: LedgerView, parent: dict) -> None:
    parent["status"] = model.PARENT_EXPIRED
    ctx.audit(parent["parent_id"], None, model.PARENT_OPEN, model.PARENT_EXPIRED, "parent lease expired")
    accounting.fence_parent(ctx, view, parent, "parent_expired")
    accounting.finish_parent_if_done(ctx, view, parent)


# -- reservations and dispatch --------------------------------------------------------------------------


def child_reserved(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent = _parent(ctx, view, open_only=True)
    child_id = event["child_id"]
    if view.child(parent["parent_id"], child_id) is not None:
        raise Reject(results.INVALID_TRANSITION, f"child {child_id!r} is already reserved")
    quantities = event["quantities"]
    _check_dimensions(parent, quantities, "quantities")
    if len(parent["children"]) >= MAX_CHILDREN_PER_PARENT:
        raise Reject(results.LIMIT_EXCEEDED, f"a parent has at most {MAX_CHILDREN_PER_PARENT} children")
    if parent["live_children"] >= parent["max_live_children"]:
        raise Reject(results.FANOUT_EXCEEDED, f"{parent['live_children']} live children, at most "
                                              f"{parent['max_live_children']}")
    dims = parent["dimensions"]
    short = [f"{dim} {q} > available {dims[dim]['available']}" for dim, q in sorted(quantities.items())
             if q > dims[dim]["available"]]
    if short:
        _short_of_available(ctx, view, parent, quantities, short)
    for dim, quantity in quantities.items():
        dims[dim]["available"] -= quantity
        dims[dim]["outstanding"] += quantity
    child = model.new_child(parent["parent_id"], child_id, event["branch_id"], event["attempt_id"], quantities)
    parent["children"].append(child_id)
    parent["live_children"] += 1
    parent["open_children"] += 1
    ctx.audit(parent["parent_id"], child, "", model.RESERVED, "child reserved")
    accounting.touch(ctx, view, parent, child)


def _short_of_available(ctx: EventContext, view: LedgerView, parent: dict, quantities: dict, short: list[str]) -> None:
    """A reservation beyond `available`: `exceeds_available`, unless what is lent would cover it; then the newest
    loans that cover the shortfall are asked back (siblings come first) and it is `awaiting_revocation`."""
    dims = parent["dimensions"]
    if parent["loans"] and all(q <= dims[dim]["available"] + dims[dim]["lent"] for dim, q in quantities.items()):
        shortfall = {dim: q - dims[dim]["available"] for dim, q in sorted(quantities.items())
                     if q > dims[dim]["available"]}
        asked = accounting.recall_loans(ctx, view, parent, shortfall, ctx.event["child_id"])
        recalled = [loan["loan_id"] for loan in model.open_loans(parent) if loan["revocation_requested"]]
        raise Reject(results.AWAITING_REVOCATION,
                     f"{'; '.join(short)}: lent capacity covers it; loans asked back now: "
                     f"{', '.join(asked) or 'none'}; being returned: {', '.join(recalled)}; retry once they are")
    raise Reject(results.EXCEEDS_AVAILABLE, "; ".join(short))


def child_activated(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent = _parent(ctx, view, open_only=True)
    child = _child(view, parent, event["child_id"])
    state = child["state"]
    if state in model.SETTLED_STATES or state in model.PENDING_STATES:
        raise Reject(results.DISPATCH_FENCED, f"child {child['child_id']!r} is {state}")
    _check_attempt(ctx, parent, child, event["attempt_id"])
    if state == model.CANCEL_REQUESTED and not child["activated"]:
        raise Reject(results.DISPATCH_FENCED, "cancel was requested before activation")
    if child["activated"]:
        raise Reject(results.INVALID_TRANSITION, f"child {child['child_id']!r} is already activated")
    if event["lease_generation"] < child["lease_generation"]:
        raise Reject(results.STALE_LEASE_GENERATION,
                     f"lease generation {event['lease_generation']} superseded by {child['lease_generation']}")
    child["activated"] = True
    child["lease_generation"] = event["lease_generation"]
    _start_lease(ctx, view, parent, child, event["lease_ttl_ms"])
    accounting.set_state(ctx, view, parent, child, model.ACTIVATED, "dispatch confirmed")


def _start_lease(ctx: EventContext, view: LedgerView, parent: dict, child: dict, lease_ttl_ms: int) -> None:
    deadline_ms = ctx.now_ms + lease_ttl_ms
    child["lease_expires_at_ms"] = deadline_ms
    view.add_timer(deadline_ms, model.TIMER_CHILD_LEASE, parent["parent_id"], child["child_id"])


def lease_renewed(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _held_child(ctx, view)
    state = child["state"]
    if state in model.PENDING_STATES:
        raise Reject(results.INVALID_TRANSITION, f"the lease already ended: child is {state}")
    if not child["activated"]:
        raise Reject(results.INVALID_TRANSITION, "child was never activated: there is no lease to renew")
    generation = event["lease_generation"]
    if generation < child["lease_generation"]:
        raise Reject(results.STALE_LEASE_GENERATION,
                     f"lease generation {generation} superseded by {child['lease_generation']}")
    note = "lease renewed" if generation == child["lease_generation"] else f"new lease generation {generation}"
    child["lease_generation"] = generation
    _start_lease(ctx, view, parent, child, event["lease_ttl_ms"])
    ctx.audit(parent["parent_id"], child, state, state, note)
    accounting.touch(ctx, view, parent, child)


def reservation_transferred(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _held_child(ctx, view, attempt_field="from_attempt_id")
    if child["state"] != model.RESERVED or child["activated"]:
        raise Reject(results.INVALID_TRANSITION, f"only a never-activated reserved child can be transferred "
                                                 f"(child is {child['state']})")
    child["attempt_id"] = event["to_attempt_id"]
    ctx.audit(parent["parent_id"], child, model.RESERVED, model.RESERVED,
              f"reservation transferred from attempt {event['from_attempt_id']}")
    accounting.touch(ctx, view, parent, child)


# -- outcomes -------------------------------------------------------------------------------------------


def usage_reported(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _report_target(ctx, view)
    if event["usage_report_id"] in child["usage_report_ids"]:
        raise Reject(results.DUPLICATE_USAGE_REPORT, f"usage report {event['usage_report_id']!r} was already counted")
    if len(child["usage_report_ids"]) >= MAX_USAGE_REPORTS_PER_ATTEMPT and not event["final"]:
        raise Reject(results.LIMIT_EXCEEDED, f"an attempt has at most {MAX_USAGE_REPORTS_PER_ATTEMPT} usage "
                                             "reports: report the total in its completion")
    _check_headroom(parent, event["usage"])
    _adopt_report(ctx, view, parent, child, proves_execution=True)
    child["usage_report_ids"].append(event["usage_report_id"])
    accounting.commit_usage(ctx, view, parent, child, event["usage"])
    if event["final"]:
        accounting.settle(ctx, view, parent, child, None, "final_usage")
    elif child["state"] == model.ACTIVATED:
        accounting.set_state(ctx, view, parent, child, model.PARTIALLY_CONSUMED, "usage reported")


def child_completed(ctx: EventContext, view: LedgerView) -> None:
    parent, child = _report_target(ctx, view)
    _check_headroom(parent, ctx.event["usage"])
    _adopt_report(ctx, view, parent, child, proves_execution=True)
    accounting.settle(ctx, view, parent, child, ctx.event["usage"], "completed")


def _settle_outcome(ctx: EventContext, view: LedgerView, parent: dict, child: dict, usage: dict | None,
                    reason: str, note: str = "") -> None:
    """Known usage settles (or hands the remainder to a retry); unknown usage goes to reconciliation."""
    event = ctx.event
    _check_headroom(parent, usage)
    # A failure that says the attempt ran is taken at its word (SPEC §4), whatever its usage: once the child
    # counts as activated, a later "never started" can no longer release it.
    _adopt_report(ctx, view, parent, child, proves_execution=event.get("activated", False) or _positive(usage))
    if usage is None:
        accounting.to_reconciliation(ctx, view, parent, child, f"{reason}: usage uncertain {note}".rstrip())
        return
    retry_attempt_id = event.get("retry_attempt_id")
    if retry_attempt_id and parent["status"] == model.PARENT_OPEN:
        accounting.hand_to_retry(ctx, view, parent, child, usage, retry_attempt_id)
    else:
        accounting.settle(ctx, view, parent, child, usage, reason, note)


def cancel_requested(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _held_child(ctx, view)
    state = child["state"]
    if state in model.PENDING_STATES:
        raise Reject(results.INVALID_TRANSITION, f"child is in reconciliation ({state}): nothing to cancel")
    if state == model.CANCEL_REQUESTED:
        ctx.audit(parent["parent_id"], child, state, state, f"cancel requested again: {event['reason']}")
        accounting.touch(ctx, view, parent, child)
        return
    accounting.set_state(ctx, view, parent, child, model.CANCEL_REQUESTED, f"cancel requested: {event['reason']}")


def cancel_acknowledged(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _report_target(ctx, view, lambda child: event["usage_uncertain"])
    _settle_outcome(ctx, view, parent, child, _known_usage(event), "cancel_acknowledged")


def child_failed(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _report_target(ctx, view, lambda child: _failure_is_uncertain(event, child))
    if not event["usage_uncertain"] and _failure_is_uncertain(event, child):
        # The executor says it never started, but the ledger granted the dispatch: a lost worker does not
        # prove that nothing was consumed.
        _adopt_report(ctx, view, parent, child, proves_execution=False)
        accounting.to_reconciliation(ctx, view, parent, child,
                                     "failure reported as before activation, but the ledger shows an activation")
        return
    _settle_outcome(ctx, view, parent, child, _known_usage(event), "failed", event["reason"])


def _failure_is_uncertain(event: dict, child: dict) -> bool:
    """A failure whose usage the ledger cannot take as known: said to be uncertain, or reported as before
    activation (no usage) for a child the ledger activated."""
    return event["usage_uncertain"] or (not event["activated"] and child["activated"] and event["usage"] is None)


def reconciliation_resolved(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _held_child(ctx, view, usage_field="usage")
    if child["state"] not in model.PENDING_STATES:
        raise Reject(results.INVALID_TRANSITION, f"child is {child['state']}, not in reconciliation")
    _check_headroom(parent, event["usage"])
    accounting.settle(ctx, view, parent, child, event["usage"], "reconciliation_resolved", event["resolution"])


def usage_adjustment(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent = _parent(ctx, view)
    child = _child(view, parent, event["child_id"])
    _check_dimensions(parent, event["usage"], "usage")
    _check_attempt(ctx, parent, child, event["attempt_id"])
    if child["state"] not in model.SETTLED_STATES:
        raise Reject(results.INVALID_TRANSITION, f"child is {child['state']}: adjust only after settlement, "
                                                 "report usage before it")
    _check_headroom(parent, event["usage"])
    accounting.commit_usage(ctx, view, parent, child, event["usage"])


def scheduler_release_confirmed(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent = _parent(ctx, view)
    child = _child(view, parent, event["child_id"])
    _check_attempt(ctx, parent, child, event["attempt_id"])
    dim = event["dimension"]
    quantity = child["awaiting"].get(dim)
    if quantity is None:
        raise Reject(results.INVALID_TRANSITION, f"nothing of {dim!r} awaits scheduler confirmation for this child")
    del child["awaiting"][dim]
    where, target = accounting.destination(parent)
    balance = parent["dimensions"][dim]
    balance["awaiting_confirmation"] -= quantity
    balance[target] += quantity
    child["awaiting_destination"][dim] = where
    ctx.release(parent, child, dim, quantity, where, "scheduler_confirmed")
    accounting.touch(ctx, view, parent, child)
    accounting.finish_parent_if_done(ctx, view, parent)


def speculative_winner(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent = _parent(ctx, view)
    branch_id = event["branch_id"]
    winner_id = event["winner_attempt_id"]
    branch = [view.child(parent["parent_id"], cid) for cid in parent["children"]]
    branch = [c for c in branch if c["branch_id"] == branch_id]
    winners = [c for c in branch if c["attempt_id"] == winner_id]
    if not winners:
        raise Reject(results.UNKNOWN_CHILD, f"no child of branch {branch_id!r} is held by attempt {winner_id!r}")
    if any(c["state"] == model.STRANDED for c in winners):
        # SPEC §5: a stranded child takes no event but an operator's resolution, so it cannot be named a winner
        # either (its siblings are not asked to cancel for an attempt whose outcome only an operator can settle).
        raise Reject(results.INVALID_TRANSITION, f"the winning attempt {winner_id!r} holds a stranded child")
    named = parent["winners"].get(branch_id)
    if named is not None and named != winner_id:
        raise Reject(results.INVALID_TRANSITION, f"branch {branch_id!r} already has winner {named!r}")
    parent["winners"][branch_id] = winner_id
    ctx.audit(parent["parent_id"], None, parent["status"], parent["status"],
              f"speculative winner of branch {branch_id}: {winner_id}")
    for loser in branch:
        if loser["attempt_id"] == winner_id or loser["state"] not in model.LIVE_STATES:
            continue
        if not loser["activated"]:
            # Never dispatched, and now fenced: nothing can have run, so all of it returns.
            accounting.release_remainder(ctx, view, parent, loser, "speculative_loser")
            accounting.set_state(ctx, view, parent, loser, model.RELEASED, "speculative loser, never activated")
        elif loser["state"] != model.CANCEL_REQUESTED:
            accounting.set_state(ctx, view, parent, loser, model.CANCEL_REQUESTED, "speculative loser: asked to cancel")
    accounting.touch(ctx, view, parent)
    accounting.finish_parent_if_done(ctx, view, parent)


def child_skipped(ctx: EventContext, view: LedgerView) -> None:
    event = ctx.event
    parent, child = _held_child(ctx, view)
    state = child["state"]
    if child["activated"] or state in model.PENDING_STATES:
        raise Reject(results.INVALID_TRANSITION, "a skip is only valid before activation; report the outcome instead")
    accounting.release_remainder(ctx, view, parent, child, "skipped")
    accounting.set_state(ctx, view, parent, child, model.RELEASED, f"skipped: {event['reason']}")
    accounting.finish_parent_if_done(ctx, view, parent)


# -- explicit borrowing ---------------------------------------------------------------------------------


def _find_loan(parent: dict, loan_id: str) -> dict | None:
    for loan in parent["loans"]:
        if loan["loan_id"] == loan_id:
            return loan
    return None


def loan_requested(ctx: EventContext, view: LedgerView) -> None:
    """Checked in this order: the parent (open: a closing, expired or closed parent lends nothing), the loan (new),
    the dimensions (the parent's), the ledger's limit of loans, the policy (a lending limit for every dimension
    named, then the limit itself), loans being recalled (siblings come first), then `available`."""
    event = ctx.event
    parent = _parent(ctx, view, open_only=True)
    loan_id = event["loan_id"]
    if _find_loan(parent, loan_id) is not None:
        raise Reject(results.INVALID_TRANSITION, f"loan {loan_id!r} of parent {parent['parent_id']!r} already exists")
    quantities = event["quantities"]
    _check_dimensions(parent, quantities, "quantities")
    if len(parent["loans"]) >= MAX_LOANS_PER_PARENT:
        raise Reject(results.LIMIT_EXCEEDED, f"a parent has at most {MAX_LOANS_PER_PARENT} loans")
    limits = parent["lending_limit"]
    not_allowed = [dim for dim in sorted(quantities) if limits.get(dim, 0) <= 0]
    if not_allowed:
        raise Reject(results.LENDING_NOT_ALLOWED, f"the parent's policy lends no {', '.join(not_allowed)}")
    dims = parent["dimensions"]
    over = [f"{dim}: lent {dims[dim]['lent']} + {q} > lending limit {limits[dim]}"
            for dim, q in sorted(quantities.items()) if dims[dim]["lent"] + q > limits[dim]]
    if over:
        raise Reject(results.EXCEEDS_LENDING_LIMIT, "; ".join(over))
    recalled = [loan["loan_id"] for loan in model.open_loans(parent) if loan["revocation_requested"]]
    if recalled:
        raise Reject(results.AWAITING_REVOCATION, f"siblings come first: loans {', '.join(recalled)} are being "
                                                  "recalled for them")
    short = [f"{dim} {q} > available {dims[dim]['available']}" for dim, q in sorted(quantities.items())
             if q > dims[dim]["available"]]
    if short:
        raise Reject(results.EXCEEDS_AVAILABLE, "; ".join(short))
    accounting.lend(ctx, view, parent, loan_id, event["borrower"], quantities)


def loan_returned(ctx: EventContext, view: LedgerView) -> None:
    """Checked in this order: the parent (known, not closed), the loan (known), the dimensions of the usage, the
    loan still open, the headroom of the usage."""
    event = ctx.event
    parent = _parent(ctx, view)
    loan = _find_loan(parent, event["loan_id"])
    if loan is None:
        raise Reject(results.UNKNOWN_LOAN, f"parent {parent['parent_id']!r} lent no loan {event['loan_id']!r}")
    usage = event["usage"]
    _check_dimensions(parent, usage, "usage")
    if loan["state"] != model.LOAN_OPEN:
        raise Reject(results.ALREADY_SETTLED, f"loan {loan['loan_id']!r} was already returned")
    _check_headroom(parent, usage)
    accounting.return_loan(ctx, view, parent, loan, usage)
    accounting.finish_parent_if_done(ctx, view, parent)


# -- ledger time ----------------------------------------------------------------------------------------


def fire_timer(ctx: EventContext, view: LedgerView, deadline_ms: int, kind: str, parent_id: str,
               child_id: str) -> None:
    """A tick passed a deadline. Timers are never cancelled, so first check the record still has it."""
    parent = view.parent(parent_id)
    if parent is None:
        return
    if kind == model.TIMER_PARENT_LEASE:
        if parent["status"] == model.PARENT_OPEN and parent["lease_expires_at_ms"] == deadline_ms:
            expire_parent(ctx, view, parent)
        return
    if kind == model.TIMER_PARENT_RETENTION:
        if parent["status"] == model.PARENT_CLOSED and not model.is_compacted(parent):
            accounting.compact_parent(ctx, view, parent)
        return
    child = view.child(parent_id, child_id)
    if child is None:
        return
    if kind == model.TIMER_CHILD_LEASE:
        if child["state"] in model.LIVE_STATES and child["lease_expires_at_ms"] == deadline_ms:
            accounting.to_reconciliation(ctx, view, parent, child, "reconciling after lease expiry", lease_expired=True)
    elif kind == model.TIMER_RECONCILIATION:
        if child["state"] == model.RECONCILING and child["reconcile_deadline_ms"] == deadline_ms:
            accounting.set_state(ctx, view, parent, child, model.STRANDED,
                                 "reconciliation timed out: stranded, held in pending until an operator resolves it")


def rebase_timers(ctx: EventContext, view: LedgerView, now_ms: int) -> None:
    """The partition's first tick. Leases granted before it were timed from ledger time 0, which is not a
    time but the absence of one: they start now instead, so a parent reserved before the first tick does
    not expire at it. Deterministic like any other step: replay rebases the same timers at the same tick."""
    for deadline_ms, kind, parent_id, child_id in view.pop_due_timers(_FOREVER_MS):
        if kind == model.TIMER_PARENT_RETENTION:  # closed at ledger time 0: its retention starts now too
            parent = view.parent(parent_id)
            if parent is None or parent["status"] != model.PARENT_CLOSED or model.is_compacted(parent):
                continue
            parent["closed_at_ms"] += now_ms
            view.add_timer(deadline_ms + now_ms, kind, parent_id)
            accounting.touch(ctx, view, parent)
            continue
        record = view.parent(parent_id) if kind == model.TIMER_PARENT_LEASE else view.child(parent_id, child_id)
        field = "reconcile_deadline_ms" if kind == model.TIMER_RECONCILIATION else "lease_expires_at_ms"
        if record is None or record[field] != deadline_ms:
            continue
        record[field] = deadline_ms + now_ms
        view.add_timer(deadline_ms + now_ms, kind, parent_id, child_id)
        parent = view.parent(parent_id)
        accounting.touch(ctx, view, parent, None if kind == model.TIMER_PARENT_LEASE else record)


_FOREVER_MS = 2**63 - 1

HANDLERS = {
    "ParentReserved": parent_reserved,
    "ChildReserved": child_reserved,
    "ChildActivated": child_activated,
    "LeaseRenewed": lease_renewed,
    "UsageReported": usage_reported,
    "ChildCompleted": child_completed,
    "ChildSkipped": child_skipped,
    "CancelRequested": cancel_requested,
    "CancelAcknowledged": cancel_acknowledged,
    "ChildFailed": child_failed,
    "SpeculativeWinner": speculative_winner,
    "ReservationTransferred": reservation_transferred,
    "ReconciliationResolved": reconciliation_resolved,
    "UsageAdjustment": usage_adjustment,
    "SchedulerReleaseConfirmed": scheduler_release_confirmed,
    "ParentClosed": parent_closed,
    "LoanRequested": loan_requested,
    "LoanReturned": loan_returned,
}
