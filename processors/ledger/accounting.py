"""The accounting steps every event handler is built from. Each keeps SPEC §3's invariant:

    available + outstanding + pending + awaiting_confirmation + lent + returned_to_pool + committed
        == capacity + overdrawn

by moving a quantity from one term to another (or, for an overrun, adding the same amount to both sides).
Handlers validate first and call these only once the event is known to apply: these never reject.
"""

from __future__ import annotations

from branch_settlement.processors.ledger.context import EventContext
from branch_settlement.projections import model
from branch_settlement.projections.view import LedgerView


def touch(ctx: EventContext, view: LedgerView, parent: dict, child: dict | None = None) -> None:
    # Most steps of an event touch its parent (and its child) again: once one is marked changed, the view holds this
    # very record until the checkpoint, so putting it again would change nothing (not even the order of changes).
    if ctx.touched.get(parent["parent_id"]) is not parent:
        ctx.touched[parent["parent_id"]] = parent
        view.put_parent(parent)
    if child is not None and ctx.touched_children.get(id(child)) is not child:
        ctx.touched_children[id(child)] = child
        view.put_child(child)


def set_state(ctx: EventContext, view: LedgerView, parent: dict, child: dict, new_state: str, note: str) -> None:
    """Move a child to `new_state`, with an audit record, keeping what the parent derives from its children's
    states: the live-children count, and the term that holds the child's remainder. Where the remainder is
    held is a function of the state (`model.holding_term`), so this one place moves it whenever that term
    changes (live <-> reconciliation), and no handler can forget to. Settling states hold nothing: the
    settlement step has released or committed the remainder before it calls this."""
    old_state = child["state"]
    old_term = model.holding_term(old_state)
    new_term = model.holding_term(new_state)
    if old_term != new_term and old_term is not None and new_term is not None:
        dims = parent["dimensions"]
        for dim in child["reserved"]:
            quantity = model.remainder(child, dim)
            if quantity:
                dims[dim][old_term] -= quantity
                dims[dim][new_term] += quantity
    was_live = old_state in model.LIVE_STATES
    is_live = new_state in model.LIVE_STATES
    if was_live and not is_live:
        parent["live_children"] -= 1
    elif is_live and not was_live:
        parent["live_children"] += 1
    if new_state in model.SETTLED_STATES and old_state not in model.SETTLED_STATES:
        parent["open_children"] -= 1
    child["state"] = new_state
    ctx.audit(parent["parent_id"], child, old_state, new_state, note)
    touch(ctx, view, parent, child)


def commit_usage(ctx: EventContext, view: LedgerView, parent: dict, child: dict, delta: dict[str, int]) -> None:
    """Commit confirmed usage `delta` of a child. Within the reservation it comes from where the child holds
    its remainder; beyond it (an overrun, SPEC §6) from the parent's `available`, and past that it is
    `overdrawn`. A settled child holds nothing, so all of an adjustment's usage is drawn from the parent.
    """
    term = model.holding_term(child["state"])
    dims = parent["dimensions"]
    consumed = child["consumed"]
    for dim in sorted(delta):
        quantity = delta[dim]
        if quantity <= 0:
            continue
        balance = dims[dim]
        within = min(quantity, model.remainder(child, dim)) if term else 0
        excess = quantity - within
        if within:
            balance[term] -= within
        balance["committed"] += quantity
        note = draw_overrun(ctx, balance, excess) if excess else "usage committed"
        consumed[dim] = consumed.get(dim, 0) + quantity
        ctx.audit(parent["parent_id"], child, child["state"], child["state"], note, dim, quantity)
    touch(ctx, view, parent, child)


def draw_overrun(ctx: EventContext, balance: dict, excess: int) -> str:
    """Usage beyond what was held (an overrun, SPEC §6), already in `committed`: drawn from the parent's
    `available`, the rest `overdrawn` (the event's result then says so). Returns the audit note."""
    drawn = min(excess, balance["available"])
    balance["available"] -= drawn
    balance["overdrawn"] += excess - drawn
    if excess - drawn:
        ctx.overdrawn = True
        return f"overrun of {excess}: {drawn} drawn from available, {excess - drawn} overdrawn"
    return f"overrun of {excess} drawn from available"


def destination(parent: dict) -> tuple[str, str]:
    """Where released capacity goes now: back to the parent while it is open, else to the global pool."""
    if parent["status"] == model.PARENT_OPEN:
        return model.DESTINATION_PARENT, "available"
    return model.DESTINATION_POOL, "returned_to_pool"


def release_remainder(ctx: EventContext, view: LedgerView, parent: dict, child: dict, reason: str) -> bool:
    """Return a child's unconsumed remainder: logical dimensions at once, physical ones to
    `awaiting_confirmation` until the scheduler confirms them free. Returns whether anything was returned.
    The caller moves the child to its settled state."""
    term = model.holding_term(child["state"])
    dims = parent["dimensions"]
    returned = False
    for dim in child["reserved"]:
        quantity = model.remainder(child, dim)
        if quantity <= 0:
            continue
        returned = True
        balance = dims[dim]
        balance[term] -= quantity
        if balance["kind"] == model.PHYSICAL:
            balance["awaiting_confirmation"] += quantity
            child["awaiting"][dim] = quantity
            ctx.audit(parent["parent_id"], child, child["state"], child["state"],
                      f"{reason}: awaiting scheduler confirmation", dim, quantity)
            continue
        where, target = destination(parent)
        balance[target] += quantity
        ctx.release(parent, child, dim, quantity, where, reason)
    touch(ctx, view, parent, child)
    return returned


def settle(ctx: EventContext, view: LedgerView, parent: dict, child: dict, total: dict[str, int] | None,
           reason: str, note: str = "") -> None:
    """The settlement step: commit confirmed usage up to `total` (the attempt's total; None = nothing
    more than already committed), release the remainder, and mark the child committed or released.
    `reason` is the release's reason code; `note` adds the reporter's words to the audit record."""
    if total:
        commit_usage(ctx, view, parent, child, usage_delta(ctx, parent, child, total))
    returned = release_remainder(ctx, view, parent, child, reason)
    set_state(ctx, view, parent, child, model.RELEASED if returned else model.COMMITTED,
              f"{reason}: {note}" if note else reason)
    finish_parent_if_done(ctx, view, parent)


def usage_delta(ctx: EventContext, parent: dict, child: dict, total: dict[str, int]) -> dict[str, int]:
    """The part of a reported total not yet committed. A total below what earlier deltas committed is
    recorded, never used to reverse committed usage."""
    delta = {}
    for dim, quantity in total.items():
        already = child["consumed"].get(dim, 0)
        if quantity < already:
            ctx.audit(parent["parent_id"], child, child["state"], child["state"],
                      f"reported total {quantity} is below committed usage {already}: committed usage is "
                      "never reversed", dim, quantity)
        delta[dim] = quantity - already
    return delta


def hand_to_retry(ctx: EventContext, view: LedgerView, parent: dict, child: dict, total: dict[str, int],
                  retry_attempt_id: str) -> None:
    """Commit the failed attempt's usage and keep the remainder with the child for the retry attempt, in
    one step: the capacity never passes through the parent, so no sibling can take it in between. From
    reconciliation too (SPEC §4): the usage is committed out of `pending`, and the child, live again, holds
    its remainder in `outstanding` (set_state moves it)."""
    commit_usage(ctx, view, parent, child, usage_delta(ctx, parent, child, total))
    old_attempt = child["attempt_id"]
    earlier = child["earlier_attempts_consumed"]
    for dim, quantity in child["consumed"].items():
        if quantity:
            earlier[dim] = earlier.get(dim, 0) + quantity
    child["earlier_attempts_consumed"] = dict(sorted(earlier.items()))
    child["reserved"] = {dim: model.remainder(child, dim) for dim in child["reserved"]}
    child["consumed"] = {dim: 0 for dim in child["reserved"]}
    child["attempt_id"] = retry_attempt_id
    child["lease_generation"] += 1
    child["activated"] = False
    child["lease_expires_at_ms"] = None
    child["reconcile_deadline_ms"] = None
    child["usage_report_ids"] = []
    set_state(ctx, view, parent, child, model.RESERVED, f"remainder handed from attempt {old_attempt} to retry")


def to_reconciliation(ctx: EventContext, view: LedgerView, parent: dict, child: dict, note: str, *,
                      lease_expired: bool = False) -> None:
    """Outcome unknown: the child enters reconciliation, so its remainder is held in `pending` (never in
    `available`: set_state moves it) until a late report or an operator settles it, or the reconciliation
    timeout strands it. A lease expiry passes through `expired` first, so the audit trail shows both steps."""
    deadline_ms = ctx.now_ms + parent["reconciliation_timeout_ms"]
    child["reconcile_deadline_ms"] = deadline_ms
    child["lease_expires_at_ms"] = None
    view.add_timer(deadline_ms, model.TIMER_RECONCILIATION, parent["parent_id"], child["child_id"])
    if lease_expired:
        set_state(ctx, view, parent, child, model.EXPIRED, "lease expired: expired never means unused")
    set_state(ctx, view, parent, child, model.RECONCILING, note)


def fence_parent(ctx: EventContext, view: LedgerView, parent: dict, reason: str) -> None:
    """The parent closed or expired: its unassigned balance and the remainders of children that were
    never activated (the fence guarantees they never will be) go to the global pool now, and every open loan
    not yet asked back is asked back (`reason`: parent_closed or parent_expired)."""
    for loan in parent["loans"]:
        if loan["state"] == model.LOAN_OPEN and not loan["revocation_requested"]:
            ask_loan_back(ctx, parent, loan, reason)
    for dim, balance in parent["dimensions"].items():
        quantity = balance["available"]
        if quantity:
            balance["available"] = 0
            balance["returned_to_pool"] += quantity
            ctx.release(parent, None, dim, quantity, model.DESTINATION_POOL, reason)
    for child_id in parent["children"]:
        child = view.child(parent["parent_id"], child_id)
        if child["state"] in model.LIVE_STATES and not child["activated"]:
            release_remainder(ctx, view, parent, child, reason)
            set_state(ctx, view, parent, child, model.RELEASED, f"{reason}: never activated, dispatch fenced")
    touch(ctx, view, parent)


def finish_parent_if_done(ctx: EventContext, view: LedgerView, parent: dict) -> None:
    """A closing or expired parent whose children are all settled (none live, none in reconciliation, even
    one that holds nothing more), with no loan open and with nothing awaiting confirmation is closed, and its summary
    (`ParentSettled`) is emitted."""
    if parent["status"] not in (model.PARENT_CLOSING, model.PARENT_EXPIRED) or parent["open_children"]:
        return
    for loan in parent["loans"]:
        if loan["state"] == model.LOAN_OPEN:
            return
    for balance in parent["dimensions"].values():
        if balance["outstanding"] or balance["pending"] or balance["awaiting_confirmation"]:
            return
    prior = parent["status"]
    parent["status"] = model.PARENT_CLOSED
    if parent["outcome"] is None:
        parent["outcome"] = "expired"
    parent["closed_at_ms"] = ctx.now_ms
    retention_ms = model.CLOSED_PARENT_RETENTION_MS
    if retention_ms is not None:
        view.add_timer(ctx.now_ms + retention_ms, model.TIMER_PARENT_RETENTION, parent["parent_id"])
    ctx.audit(parent["parent_id"], None, prior, model.PARENT_CLOSED, "parent settled")
    event = ctx.event
    ctx.out.settled.append(
        {
            "parent_id": parent["parent_id"],
            "outcome": parent["outcome"],
            "dimensions": {dim: dict(balance) for dim, balance in parent["dimensions"].items()},
            "idempotency_key": event["idempotency_key"],
            "triggering_event_id": event["event_id"],
            "input_partition": ctx.partition,
            "input_offset": ctx.offset,
            "ledger_time_ms": ctx.now_ms,
        }
    )
    touch(ctx, view, parent)


# -- explicit borrowing -----------------------------------------------------------------------------------


def lend(ctx: EventContext, view: LedgerView, parent: dict, loan_id: str, borrower: str,
         quantities: dict[str, int]) -> None:
    """A loan: each quantity moves from `available` to `lent`; the loan joins the parent's list (newest last)."""
    dims = parent["dimensions"]
    loan = model.new_loan(loan_id, borrower, quantities, ctx.now_ms)
    parent["loans"].append(loan)
    for dim, quantity in loan["quantities"].items():
        dims[dim]["available"] -= quantity
        dims[dim]["lent"] += quantity
        ctx.audit(parent["parent_id"], None, "", model.AUDIT_LOAN_OPEN,
                  f"loan {loan_id} lent to {borrower}", dim, quantity)
    touch(ctx, view, parent)


def ask_loan_back(ctx: EventContext, parent: dict, loan: dict, reason: str, child_id: str = "") -> None:
    """Emit the loan's one LoanRevocationRequested, with an audit record; the caller touches the parent."""
    loan["revocation_requested"] = True
    ctx.revocation(parent, loan, reason, child_id)
    why = f"child {child_id} needs the capacity" if child_id else reason
    ctx.audit(parent["parent_id"], None, model.AUDIT_LOAN_OPEN, model.AUDIT_LOAN_OPEN,
              f"loan {loan['loan_id']} of {loan['borrower']}: revocation requested ({why})")


def recall_loans(ctx: EventContext, view: LedgerView, parent: dict, shortfall: dict[str, int],
                 child_id: str) -> list[str]:
    """A sibling's reservation is short by `shortfall` (per dimension, beyond `available`) and what is lent
    covers it: ask back the newest open loans that together cover the shortfall, counting the loans already
    asked (each loan is asked once), skipping loans that hold nothing of a dimension still short. Returns the
    ids of the loans asked now."""
    need = dict(shortfall)
    open_loans = model.open_loans(parent)
    for loan in open_loans:
        if loan["revocation_requested"]:
            for dim in need:
                need[dim] -= loan["quantities"].get(dim, 0)
    asked = []
    for loan in reversed(open_loans):
        if all(quantity <= 0 for quantity in need.values()):
            break
        if loan["revocation_requested"]:
            continue
        held = loan["quantities"]
        if not any(held.get(dim, 0) > 0 for dim, quantity in need.items() if quantity > 0):
            continue
        ask_loan_back(ctx, parent, loan, "sibling_needs_capacity", child_id)
        asked.append(loan["loan_id"])
        for dim in need:
            need[dim] -= held.get(dim, 0)
    touch(ctx, view, parent)
    return asked


def return_loan(ctx: EventContext, view: LedgerView, parent: dict, loan: dict, usage: dict[str, int]) -> None:
    """The borrower returns `loan` with its total `usage`: per dimension the usage is committed out of `lent`;
    beyond the loan it is an overrun (SPEC §6), drawn from `available`, the rest `overdrawn`; what the borrower
    did not use goes back to `available` while the parent is open, else to the global pool. The borrower's
    return is itself the confirmation that the capacity is free (no scheduler confirmation for a loan)."""
    dims = parent["dimensions"]
    where, target = destination(parent)
    lent = loan["quantities"]
    loan_id = loan["loan_id"]
    parent_id = parent["parent_id"]
    for dim in sorted(lent.keys() | usage.keys()):
        quantity, used = lent.get(dim, 0), usage.get(dim, 0)
        balance = dims[dim]
        within = min(used, quantity)
        excess = used - within
        balance["lent"] -= quantity
        balance["committed"] += used
        if used:
            note = f"loan {loan_id}: " + (draw_overrun(ctx, balance, excess) if excess else "usage committed")
            ctx.audit(parent_id, None, model.AUDIT_LOAN_OPEN, model.AUDIT_LOAN_OPEN, note, dim, used)
        left = quantity - within
        if left:
            balance[target] += left
            ctx.release(parent, None, dim, left, where, model.RELEASE_LOAN_RETURNED)
    loan["state"] = model.LOAN_RETURNED
    loan["usage"] = {dim: used for dim, used in sorted(usage.items()) if used}
    ctx.audit(parent_id, None, model.AUDIT_LOAN_OPEN, model.AUDIT_LOAN_RETURNED,
              f"loan {loan_id} returned by {loan['borrower']}")
    touch(ctx, view, parent)


# -- retention ------------------------------------------------------------------------------------------


def compact_parent(ctx: EventContext, view: LedgerView, parent: dict) -> None:
    """A tick passed the closed parent's retention (model.CLOSED_PARENT_RETENTION_MS after it closed): delete its
    children, its idempotency records and its pending timers, and cut the parent record down to a tombstone that
    still says `closed` (SPEC §8), so a late event, a redelivery or a ParentReserved reusing the id gets
    `parent_closed`, never a fresh ledger. A closed parent holds nothing (no live child, none in reconciliation,
    nothing awaiting confirmation, no open loan), so nothing is released and no balance moves: its final balances
    were published in its ParentSettled. One audit record says what was deleted."""
    parent_id = parent["parent_id"]
    children = parent["children"]
    for child_id in children:
        view.delete_child(parent_id, child_id)
    idempotency = view.delete_idempotency_of(parent_id)
    view.drop_timers_of(parent_id)
    ctx.audit(parent_id, None, model.PARENT_CLOSED, model.PARENT_CLOSED,
              f"compacted after its retention ({model.CLOSED_PARENT_RETENTION_MS} ms of ledger time since it closed "
              f"at {parent['closed_at_ms']}): deleted {len(children)} children, {idempotency} idempotency records "
              "and its pending timers; the parent is kept as a tombstone, late events get parent_closed")
    parent["children"] = []
    parent["winners"] = {}
    parent["dimensions"] = {}
    parent["loans"] = []
    parent["compacted_at_ms"] = ctx.now_ms
    touch(ctx, view, parent)
