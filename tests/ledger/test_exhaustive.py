"""The bounded exhaustive check (tests/ledger/exhaustive.py) at a modest depth, and proof that it fails for the
right reason: a fold that forgets to move a remainder between `outstanding` and `pending` (the invariant's
sum still holds) is caught, with the sequence that shows it. `make verify DEPTH=N` goes deeper."""

from __future__ import annotations

import pytest

from branch_settlement.processors.ledger import accounting
from branch_settlement.projections import model
from tests.ledger import exhaustive

pytestmark = pytest.mark.unit

# Per start state, the depth `make test` explores and the distinct states it must at least reach there.
DEPTHS = {"parent": (4, 10_000), "running": (3, 8_000), "lending": (5, 1_000)}
ALPHABET_AT_LEAST = {"main": 70, "lending": 15}


@pytest.mark.parametrize("start", sorted(DEPTHS))
def test_every_sequence_up_to_the_depth_keeps_every_rule(start: str, capsys) -> None:
    depth, at_least = DEPTHS[start]
    counts = exhaustive.explore(depth, report=print, start_name=start)
    universe = exhaustive.STARTS[start][0]
    assert counts["alphabet"] == len(exhaustive.UNIVERSES[universe][0]()) >= ALPHABET_AT_LEAST[universe]
    # Every depth reaches new ledgers: the universe is not exhausted, so the depth is what bounds the check.
    assert all(new > 0 for new in counts["new_per_depth"])
    assert counts["distinct_states"] > at_least
    with capsys.disabled():
        print(f"\nexhaustive check from {start!r}: depth {depth}, {counts['distinct_states']} distinct states, "
              f"{counts['steps']} steps")


def test_the_alphabet_covers_every_event_type() -> None:
    from branch_settlement.schemas.codec import EVENT_TYPES
    assert {event["type"] for event in exhaustive.alphabet().values()} == set(EVENT_TYPES)
    lending = {event["type"] for event in exhaustive.lending_alphabet().values()}
    assert {"LoanRequested", "LoanReturned", "ChildReserved", "ParentClosed", "Tick"} <= lending


def _set_state_forgetting_the_remainder(ctx, view, parent, child, new_state, note):
    """set_state as it was before the remainder followed the state: counts and audit, no move."""
    old_state = child["state"]
    if old_state in model.LIVE_STATES and new_state not in model.LIVE_STATES:
        parent["live_children"] -= 1
    elif new_state in model.LIVE_STATES and old_state not in model.LIVE_STATES:
        parent["live_children"] += 1
    if new_state in model.SETTLED_STATES and old_state not in model.SETTLED_STATES:
        parent["open_children"] -= 1
    child["state"] = new_state
    ctx.audit(parent["parent_id"], child, old_state, new_state, note)
    accounting.touch(ctx, view, parent, child)


def test_a_remainder_left_in_the_wrong_term_is_found(monkeypatch) -> None:
    monkeypatch.setattr(accounting, "set_state", _set_state_forgetting_the_remainder)
    with pytest.raises(exhaustive.CheckFailure) as failure:
        exhaustive.explore(3)
    message = str(failure.value)
    assert "recomputed" in message and "sequence: tick 0 -> reserve-parent -> " in message


def _recall_oldest_first(ctx, view, parent, shortfall, child_id):
    """recall_loans walking the loans from the oldest: asks loans a newer one would have spared."""
    need = dict(shortfall)
    asked = []
    for loan in model.open_loans(parent):
        if all(q <= 0 for q in need.values()):
            break
        if loan["revocation_requested"]:
            for dim in need:
                need[dim] -= loan["quantities"].get(dim, 0)
            continue
        accounting.ask_loan_back(ctx, parent, loan, "sibling_needs_capacity", child_id)
        asked.append(loan["loan_id"])
        for dim in need:
            need[dim] -= loan["quantities"].get(dim, 0)
    accounting.touch(ctx, view, parent)
    return asked


def test_a_revocation_of_older_loans_than_needed_is_found(monkeypatch) -> None:
    monkeypatch.setattr(accounting, "recall_loans", _recall_oldest_first)
    with pytest.raises(exhaustive.CheckFailure) as failure:
        exhaustive.explore(4, start_name="lending")
    assert "the newest loans needed are" in str(failure.value)


def test_a_parent_closing_with_a_loan_open_is_found(monkeypatch) -> None:
    def finish_ignoring_loans(ctx, view, parent):
        loans, parent["loans"] = parent["loans"], []
        try:
            original(ctx, view, parent)
        finally:
            parent["loans"] = loans

    original = accounting.finish_parent_if_done
    monkeypatch.setattr(accounting, "finish_parent_if_done", finish_ignoring_loans)
    with pytest.raises(exhaustive.CheckFailure) as failure:
        exhaustive.explore(3, start_name="lending")
    assert "closed with" in str(failure.value)
