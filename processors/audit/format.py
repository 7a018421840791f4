"""Words for the audit reports: times, labels and what one step changed. Shared by the text and HTML
renderers, so both say the same thing about the same step."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from branch_settlement.processors.ledger import results
from branch_settlement.processors.audit.history import PARENT_ROW, Step
from branch_settlement.projections import model

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
ARROW = "→"
# Where a release that names no child comes from: the parent's unassigned balance.
PARENT_SOURCE = "parent (available)"
# Where a release of what a borrower did not use comes from (explicit borrowing).
LOAN_SOURCE = "loan"

# Balance terms as people read them, in the ledger's order.
TERM_LABELS = {
    "capacity": "capacity",
    "available": "available",
    "outstanding": "outstanding",
    "pending": "pending",
    "awaiting_confirmation": "awaiting confirmation",
    "lent": "lent",
    "returned_to_pool": "returned to pool",
    "committed": "committed",
    "overdrawn": "overdrawn",
}


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as ISO 8601 UTC with milliseconds (integer arithmetic: no float rounding)."""
    return (EPOCH + timedelta(milliseconds=ms)).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def clock_ms(ms: int) -> str:
    """Time of day, UTC, with milliseconds: for axes where the date is said once."""
    return iso_ms(ms)[11:23]


def release_source(rel: dict) -> str:
    """Where a release comes from, as the tables say it: a child, the parent's available balance, or a loan."""
    if rel["child_id"]:
        return who(rel["child_id"], rel["attempt_id"])
    return LOAN_SOURCE if rel["reason"] == model.RELEASE_LOAN_RETURNED else PARENT_SOURCE


def who(child_id: str, attempt_id: str) -> str:
    if not child_id:
        return attempt_id or "-"
    return f"{child_id}/{attempt_id}" if attempt_id else child_id


def row_label(child_id: str) -> str:
    return "parent" if child_id == PARENT_ROW else child_id


def applied(step: Step) -> bool:
    return step.result in results.APPLIED


def step_changes(step: Step, before: dict[str, dict[str, int]] | None) -> list[str]:
    """What a step did to the parent, one line each: state transitions, committed quantities, notes,
    releases with their destination, balance movements, the settlement summary; or why it changed
    nothing (the result's detail)."""
    lines = _transitions(step) + _audit_notes(step)
    for rec in step.revocations:
        lines.append(revocation_line(rec))
    for rel in step.releases:
        lines.append(release_line(rel, step.child_id))
    lines += balance_moves(before, step.balances)
    if step.settled is not None:
        lines.append(f"parent settled: outcome {step.settled['outcome']}")
    if step.detail:
        lines.append(step.detail)
    if step.quiet:
        lines.append("ledger time advanced")
    return lines


def release_line(rel: dict, step_child_id: str = "") -> str:
    """`release tokens 8 → parent (completed)`; names the child when the step is not about it, and says
    `available` for the parent's unassigned balance."""
    if not rel["child_id"]:
        source = "loan " if rel["reason"] == model.RELEASE_LOAN_RETURNED else "available "
    elif rel["child_id"] != step_child_id:
        source = who(rel["child_id"], rel["attempt_id"]) + " "
    else:
        source = ""
    return (f"release {source}{rel['dimension']} {rel['quantity']} {ARROW} {rel['destination']} "
            f"({rel['reason']})")


def revocation_line(rec: dict) -> str:
    """`asked back loan L1 of batch-7 (tokens 30): sibling_needs_capacity for B`."""
    held = ", ".join(f"{dim} {q}" for dim, q in sorted(rec["quantities"].items()))
    why = f"{rec['reason']} for {rec['child_id']}" if rec["child_id"] else rec["reason"]
    return f"asked back loan {rec['loan_id']} of {rec['borrower']} ({held}): {why}"


def plural(count: int, noun: str, nouns: str = "") -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"


def balance_moves(before: dict | None, after: dict | None) -> list[str]:
    """`tokens: available 20→28, committed 20→32` for every dimension whose balances moved."""
    if after is None:
        return []
    lines = []
    for dim, balance in after.items():
        old = (before or {}).get(dim)
        moved = [f"{TERM_LABELS[term]} {old[term] if old else 0}{ARROW}{balance[term]}"
                 for term in model.BALANCE_TERMS if old is None or old[term] != balance[term]]
        if old is None:
            moved = [f"{TERM_LABELS[term]} {balance[term]}" for term in model.BALANCE_TERMS if balance[term]]
        if moved:
            lines.append(f"{dim}: " + ", ".join(moved))
    return lines


def _transitions(step: Step) -> list[str]:
    """`D/D1: activated → expired → reconciling (reconciling after lease expiry)`, one line per row."""
    chains: dict[str, list[dict]] = {}
    for audit in step.audits:
        if audit["prior_state"] != audit["new_state"] and not model.is_loan_audit(audit):
            chains.setdefault(audit["child_id"], []).append(audit)
    lines = []
    for child_id, audits in chains.items():
        states = [audits[0]["prior_state"]] + [a["new_state"] for a in audits]
        path = f" {ARROW} ".join(s for s in states if s)
        start = "" if states[0] else f"{ARROW} "
        label = "parent" if child_id == PARENT_ROW else who(child_id, audits[-1]["attempt_id"])
        lines.append(f"{label}: {start}{path} ({audits[-1]['note']})")
    return lines


def _audit_notes(step: Step) -> list[str]:
    """Audit records that changed no state: committed quantities, escalations, renewals."""
    lines = []
    for audit in step.audits:
        loan = model.is_loan_audit(audit)
        if audit["prior_state"] != audit["new_state"] and not loan:
            continue
        if loan and audit["dimension"] is None and audit["prior_state"] == audit["new_state"] and step.revocations:
            continue  # a loan asked back: said by its revocation's line
        label = "loan" if loan else "parent" if audit["child_id"] == PARENT_ROW else who(audit["child_id"],
                                                                                         audit["attempt_id"])
        quantity = f" {audit['dimension']} {audit['quantity']}" if audit["dimension"] is not None else ""
        lines.append(f"{label}{quantity}: {audit['note']}")
    return lines
