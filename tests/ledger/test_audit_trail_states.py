"""Every change of a child's state is an audit record, and its audit records chain: each one's prior state is the
state the last one left (empty for a new child), and the last one's new state is the child's state in the ledger.
The ledger gauges count children by state from these records alone (processors/kafka/reporting.py,
`LedgerStats.count_audits`), so a state changed without one, or an audit record naming a prior state the child
was not in, would put them wrong. Checked after every event of the reference-model test's seeded adversarial
streams, with retention short enough that closed parents are compacted (their children deleted) within them,
for both implementations of the fold."""

from __future__ import annotations

import pytest

from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.replay.replayer import open_view
from branch_settlement.projections import model
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import default_codec
from tests.ledger.test_reference_model import Stream

pytestmark = pytest.mark.unit


def check_stream(seed: int, length: int) -> dict[str, int]:
    """Fold the seed's stream; after each event compare every child's audited state with the ledger. What the
    stream went through, for the test that it is not vacuous."""
    store = MemoryStore()
    view = open_view(store, default_codec())
    fold = Fold(view)
    chain: dict[tuple[str, str], str] = {}  # (parent, child) -> the state its last audit record left
    parents: set[str] = set()
    seen = {"transitions": 0, "expired": 0, "deleted": 0}
    for offset, event in enumerate(Stream(seed, length).build()):
        out = Outputs()
        fold.apply(event, offset, out, ledger_tick=event["type"] == "Tick")
        where = f"seed {seed}, event {offset} ({event['type']})"
        for audit in out.audits:
            if not audit["child_id"]:
                continue
            key = (audit["parent_id"], audit["child_id"])
            assert audit["prior_state"] == chain.get(key, ""), f"{where}: {audit}"
            chain[key] = audit["new_state"]
            seen["transitions"] += audit["prior_state"] != audit["new_state"]
            seen["expired"] += audit["new_state"] == model.EXPIRED
            parents.add(audit["parent_id"])
        if event.get("parent_id"):
            parents.add(event["parent_id"])
        for parent_id in parents:
            parent = view.parent(parent_id)
            for child_id in parent["children"] if parent is not None else ():
                assert (parent_id, child_id) in chain, f"{where}: child {child_id} of {parent_id} never audited"
        for (parent_id, child_id), state in list(chain.items()):
            child = view.child(parent_id, child_id)
            if child is None:  # deleted by retention: settled for good
                assert state in model.SETTLED_STATES, f"{where}: {child_id} deleted while {state}"
                del chain[(parent_id, child_id)]
                seen["deleted"] += 1
                continue
            assert state != model.EXPIRED, f"{where}: {child_id} left in `expired`"
            assert child["state"] == state, f"{where}: {child_id} is {child['state']}, its audit trail says {state}"
        if offset % 50 == 49:
            store.write(view.changes(), offset)
            view.mark_committed()
    return seen


@pytest.mark.parametrize("implementation", [native.COMPILED, native.PYTHON])
def test_every_change_of_a_childs_state_is_an_audit_record_that_chains(implementation: str, monkeypatch) -> None:
    if implementation == native.COMPILED and native.module() is None:
        pytest.skip("needs the compiled module")  # CI builds it: never skipped there
    monkeypatch.setenv(native.ENV, implementation)
    monkeypatch.setattr(model, "CLOSED_PARENT_RETENTION_MS", 300_000)
    seen = {"transitions": 0, "expired": 0, "deleted": 0}
    for seed in range(1000, 1012):
        for name, n in check_stream(seed, 600).items():
            seen[name] += n
    assert seen["transitions"] > 1000 and seen["expired"] > 0 and seen["deleted"] > 0, seen
