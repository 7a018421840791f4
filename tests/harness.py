"""A ledger under test: build events in their JSON form, normalise them through the codec exactly as
replay does, fold them with the ledger auditor checking every balance term after every event
(processors/ledger/auditor.py), and read balances back."""

from __future__ import annotations

import itertools

from branch_settlement.processors.ledger.auditor import AuditedFold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.replay.replayer import open_view
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas.codec import default_codec

T0 = 1_764_410_400_000
PARENT = "P"


class Ledger:
    def __init__(self, store=None) -> None:
        self.codec = default_codec()
        self.store = store if store is not None else MemoryStore()
        self.view = open_view(self.store, self.codec)
        self.fold = AuditedFold(self.view)
        self.out = Outputs()
        self._offsets = itertools.count()
        self._ids = itertools.count(1)

    # -- sending --------------------------------------------------------------------------------------

    def event(self, etype: str, key: str | None = None, parent_id: str = PARENT, **fields) -> dict:
        n = next(self._ids)
        obj = {
            "type": etype,
            "event_id": f"e{n}",
            "idempotency_key": key or f"{parent_id}/{etype}/{n}",
            "parent_id": parent_id,
            "occurred_at_ms": T0 + n,
            **fields,
        }
        return self.codec.event_from_json(obj)

    def apply(self, event: dict) -> dict:
        return self.fold.apply(event, next(self._offsets), self.out)

    def send(self, etype: str, key: str | None = None, parent_id: str = PARENT, **fields) -> str:
        return self.apply(self.event(etype, key, parent_id, **fields))["result"]

    def checkpoint(self) -> None:
        self.store.write(self.view.changes(), next(self._offsets))
        self.view.mark_committed()

    # -- common steps ---------------------------------------------------------------------------------

    def tick(self, now_ms: int) -> str:
        return self.send("Tick", key=f"tick/0/{now_ms}", parent_id="", now_ms=now_ms)

    def open_parent(self, tokens: int = 100, gpus: int | None = None, max_live: int = 8,
                    lease_ttl_ms: int = 3_600_000, reconciliation_timeout_ms: int = 600_000,
                    parent_id: str = PARENT, lending_limit: dict | None = None) -> str:
        capacity = {"tokens": {"quantity": tokens, "kind": "logical"}}
        if gpus is not None:
            capacity["gpus"] = {"quantity": gpus, "kind": "physical"}
        return self.send("ParentReserved", parent_id=parent_id, capacity=capacity, lease_ttl_ms=lease_ttl_ms,
                         policy={"max_live_children": max_live, "reconciliation_timeout_ms": reconciliation_timeout_ms,
                                 "lending_limit": lending_limit or {}})

    def reserve(self, child: str, tokens: int = 20, gpus: int | None = None, attempt: str | None = None,
                branch: str | None = None, parent_id: str = PARENT) -> str:
        quantities = {"tokens": tokens} if gpus is None else {"tokens": tokens, "gpus": gpus}
        return self.send("ChildReserved", parent_id=parent_id, child_id=child, branch_id=branch or child,
                         attempt_id=attempt or f"{child}1", quantities=quantities)

    def activate(self, child: str, attempt: str | None = None, generation: int = 1, lease_ttl_ms: int = 60_000) -> str:
        return self.send("ChildActivated", child_id=child, attempt_id=attempt or f"{child}1",
                         lease_generation=generation, lease_ttl_ms=lease_ttl_ms)

    def lend(self, loan_id: str, tokens: int | None = 20, gpus: int | None = None, borrower: str = "batch",
             parent_id: str = PARENT, **quantities) -> str:
        """A LoanRequested under the loan's own key (`parent_id/loan/<loan_id>/request`)."""
        if tokens is not None:
            quantities["tokens"] = tokens
        if gpus is not None:
            quantities["gpus"] = gpus
        return self.send("LoanRequested", key=f"{parent_id}/loan/{loan_id}/request", parent_id=parent_id,
                         loan_id=loan_id, borrower=borrower, quantities=quantities)

    def return_loan(self, loan_id: str, parent_id: str = PARENT, **usage) -> str:
        """A LoanReturned under the loan's own key, with the borrower's total usage per dimension."""
        return self.send("LoanReturned", key=f"{parent_id}/loan/{loan_id}/return", parent_id=parent_id,
                         loan_id=loan_id, usage=usage)

    def loan(self, loan_id: str, parent_id: str = PARENT) -> dict | None:
        return next((loan for loan in self.view.parent(parent_id)["loans"] if loan["loan_id"] == loan_id), None)

    def revoked(self) -> list[str]:
        """The loan ids asked back so far, in order."""
        return [r["loan_id"] for r in self.out.revocations]

    # -- reading --------------------------------------------------------------------------------------

    def balance(self, dim: str = "tokens", parent_id: str = PARENT) -> dict:
        return dict(self.view.parent(parent_id)["dimensions"][dim])

    def child(self, child_id: str, parent_id: str = PARENT) -> dict:
        return self.view.child(parent_id, child_id)

    def state(self, child_id: str, parent_id: str = PARENT) -> str:
        return self.child(child_id, parent_id)["state"]

    def status(self, parent_id: str = PARENT) -> str:
        return self.view.parent(parent_id)["status"]

    def releases(self) -> list[tuple]:
        return [(r["child_id"], r["dimension"], r["quantity"], r["destination"]) for r in self.out.releases]


def terms(**expected) -> dict:
    """Expected balance terms; unnamed ones are not checked."""
    return expected
