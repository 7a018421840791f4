"""A deliberately simple reference model of the ledger, for a restricted event vocabulary.

It shares no code with the fold. Where the fold moves quantities between balance terms event by event,
the model keeps only per-child facts (reserved, consumed, state) plus the two numbers that history alone
determines (returned_to_pool, overdrawn), and derives every balance from them:

    outstanding = Σ remainder of live children        committed = Σ consumed of all children
    pending     = Σ remainder of children in reconciliation
    available   = capacity + overdrawn - outstanding - pending - returned_to_pool - committed

So a bookkeeping slip in the fold shows up as a different balance, not as the same slip twice.
Vocabulary: ParentReserved (logical tokens only), ChildReserved, ChildActivated, LeaseRenewed,
UsageReported, ChildCompleted, ChildSkipped, ChildFailed (uncertain), ReconciliationResolved, ParentClosed, Tick.
"""

from __future__ import annotations

LIVE = {"reserved", "activated", "partially_consumed"}
PENDING = {"reconciling", "stranded"}
SETTLED = {"committed", "released"}


class ModelChild:
    def __init__(self, attempt: str, reserved: int) -> None:
        self.attempt = attempt
        self.reserved = reserved
        self.consumed = 0
        self.state = "reserved"
        self.activated = False
        self.generation = 0
        self.lease_deadline: int | None = None
        self.recon_deadline: int | None = None
        self.reports: set[str] = set()

    @property
    def remainder(self) -> int:
        return max(self.reserved - self.consumed, 0)


class ModelParent:
    def __init__(self, capacity: int, max_live: int, recon_timeout: int) -> None:
        self.capacity = capacity
        self.max_live = max_live
        self.recon_timeout = recon_timeout
        self.status = "open"
        self.returned = 0
        self.overdrawn = 0
        self.children: dict[str, ModelChild] = {}

    def total(self, states: set[str]) -> int:
        return sum(c.remainder for c in self.children.values() if c.state in states)

    def balances(self) -> dict:
        outstanding = self.total(LIVE)
        pending = self.total(PENDING)
        committed = sum(c.consumed for c in self.children.values())
        available = self.capacity + self.overdrawn - outstanding - pending - self.returned - committed
        return {"capacity": self.capacity, "available": available, "outstanding": outstanding,
                "pending": pending, "returned_to_pool": self.returned, "committed": committed,
                "overdrawn": self.overdrawn}


class Model:
    def __init__(self) -> None:
        self.parents: dict[str, ModelParent] = {}
        self.applied: dict[tuple[str, str], tuple[dict, str]] = {}
        self.now = 0
        self.last_tick: str | None = None

    def apply(self, e: dict) -> str:
        if e["type"] == "Tick":
            return self._tick(e)
        ident = (e["parent_id"], e["idempotency_key"])
        payload = {k: v for k, v in e.items() if k not in ("event_id", "occurred_at_ms")}
        if ident in self.applied:
            return "duplicate" if self.applied[ident][0] == payload else "idempotency_conflict"
        self._overdrawn = False
        result = getattr(self, "_" + e["type"])(e)
        if result == "ok" and self._overdrawn:
            result = "overdrawn"
        if result in ("ok", "overdrawn"):
            self.applied[ident] = (payload, result)
        return result

    # -- time ---------------------------------------------------------------------------------------------

    def _tick(self, e: dict) -> str:
        if e["now_ms"] <= self.now:
            return "duplicate" if e["idempotency_key"] == self.last_tick else "stale_tick"
        if self.last_tick is None:  # leases granted before the first tick start at it
            for parent in self.parents.values():
                for child in parent.children.values():
                    if child.lease_deadline is not None:
                        child.lease_deadline += e["now_ms"]
                    if child.recon_deadline is not None:
                        child.recon_deadline += e["now_ms"]
        self.now, self.last_tick = e["now_ms"], e["idempotency_key"]
        for parent in self.parents.values():
            for child in parent.children.values():
                if child.state in LIVE and child.lease_deadline is not None and child.lease_deadline <= self.now:
                    child.state = "reconciling"
                    child.recon_deadline = self.now + parent.recon_timeout
                elif child.state == "reconciling" and child.recon_deadline <= self.now:
                    child.state = "stranded"
        return "ok"

    # -- helpers ------------------------------------------------------------------------------------------

    def _parent(self, e: dict, open_only: bool = False):
        parent = self.parents.get(e["parent_id"])
        if parent is None:
            return None, "unknown_parent"
        if parent.status == "closed" or (open_only and parent.status != "open"):
            return None, "parent_closed"
        return parent, None

    def _child(self, e: dict, open_only: bool = False):
        parent, err = self._parent(e, open_only)
        if err:
            return None, None, err
        child = parent.children.get(e["child_id"])
        if child is None:
            return None, None, "unknown_child"
        return parent, child, None

    def _consume(self, parent: ModelParent, child: ModelChild, quantity: int) -> None:
        holds = child.state in LIVE or child.state in PENDING
        within = min(quantity, child.remainder) if holds else 0
        excess = quantity - within
        if excess:
            available = parent.balances()["available"]
            drawn = min(excess, available)
            if excess - drawn:
                self._overdrawn = True
            parent.overdrawn += excess - drawn
        child.consumed += quantity

    def _settle(self, parent: ModelParent, child: ModelChild) -> None:
        if parent.status != "open":
            parent.returned += child.remainder
        child.state = "released" if child.remainder else "committed"
        self._finish(parent)

    def _finish(self, parent: ModelParent) -> None:
        if parent.status == "closing" and not any(
                c.state in LIVE or c.state in PENDING for c in parent.children.values()):
            parent.status = "closed"

    def _report(self, e: dict):
        parent, child, err = self._child(e)
        if err:
            return None, None, err
        if e["attempt_id"] != child.attempt:
            return None, None, "superseded_attempt"
        if child.state in SETTLED:
            return None, None, "already_settled"
        if child.state == "stranded":
            return None, None, "invalid_transition"
        if e["lease_generation"] < child.generation:
            return None, None, "stale_lease_generation"
        if e["lease_generation"] > child.generation and child.state in PENDING:
            return None, None, "invalid_transition"
        return parent, child, None

    def _adopt(self, child: ModelChild, generation: int) -> None:
        child.generation = max(child.generation, generation)
        if child.state == "reserved":
            child.activated = True
            child.state = "activated"

    # -- events -------------------------------------------------------------------------------------------

    def _ParentReserved(self, e: dict) -> str:
        if e["parent_id"] in self.parents:
            return "parent_closed" if self.parents[e["parent_id"]].status == "closed" else "invalid_transition"
        policy = e["policy"]
        self.parents[e["parent_id"]] = ModelParent(e["capacity"]["tokens"]["quantity"], policy["max_live_children"],
                                                   policy["reconciliation_timeout_ms"])
        return "ok"

    def _ChildReserved(self, e: dict) -> str:
        parent, err = self._parent(e, open_only=True)
        if err:
            return err
        if e["child_id"] in parent.children:
            return "invalid_transition"
        if sum(c.state in LIVE for c in parent.children.values()) >= parent.max_live:
            return "fanout_exceeded"
        if e["quantities"]["tokens"] > parent.balances()["available"]:
            return "exceeds_available"
        parent.children[e["child_id"]] = ModelChild(e["attempt_id"], e["quantities"]["tokens"])
        return "ok"

    def _ChildActivated(self, e: dict) -> str:
        parent, child, err = self._child(e, open_only=True)
        if err:
            return err
        if child.state in SETTLED or child.state in PENDING:
            return "dispatch_fenced"
        if e["attempt_id"] != child.attempt:
            return "superseded_attempt"
        if child.activated:
            return "invalid_transition"
        if e["lease_generation"] < child.generation:
            return "stale_lease_generation"
        child.activated, child.state, child.generation = True, "activated", e["lease_generation"]
        child.lease_deadline = self.now + e["lease_ttl_ms"]
        return "ok"

    def _LeaseRenewed(self, e: dict) -> str:
        parent, child, err = self._child(e)
        if err:
            return err
        if e["attempt_id"] != child.attempt:
            return "superseded_attempt"
        if child.state in SETTLED:
            return "already_settled"
        if child.state in PENDING or not child.activated:
            return "invalid_transition"
        if e["lease_generation"] < child.generation:
            return "stale_lease_generation"
        child.generation = e["lease_generation"]
        child.lease_deadline = self.now + e["lease_ttl_ms"]
        return "ok"

    def _UsageReported(self, e: dict) -> str:
        parent, child, err = self._report(e)
        if err:
            return err
        if e["usage_report_id"] in child.reports:
            return "duplicate_usage_report"
        self._adopt(child, e["lease_generation"])
        child.reports.add(e["usage_report_id"])
        self._consume(parent, child, e["usage"].get("tokens", 0))
        if e["final"]:
            self._settle(parent, child)
        elif child.state == "activated":
            child.state = "partially_consumed"
        return "ok"

    def _ChildCompleted(self, e: dict) -> str:
        parent, child, err = self._report(e)
        if err:
            return err
        self._adopt(child, e["lease_generation"])
        self._consume(parent, child, max(e["usage"].get("tokens", 0) - child.consumed, 0))
        self._settle(parent, child)
        return "ok"

    def _ChildSkipped(self, e: dict) -> str:
        parent, child, err = self._child(e)
        if err:
            return err
        if e["attempt_id"] != child.attempt:
            return "superseded_attempt"
        if child.state in SETTLED:
            return "already_settled"
        if child.activated or child.state in PENDING:
            return "invalid_transition"
        self._settle(parent, child)
        return "ok"

    def _ChildFailed(self, e: dict) -> str:  # the vocabulary has only activated, uncertain failures
        parent, child, err = self._report(e)
        if err:
            return err
        if child.state in PENDING:
            return "invalid_transition"
        child.state = "reconciling"
        child.recon_deadline = self.now + parent.recon_timeout
        return "ok"

    def _ReconciliationResolved(self, e: dict) -> str:
        parent, child, err = self._child(e)
        if err:
            return err
        if e["attempt_id"] != child.attempt:
            return "superseded_attempt"
        if child.state in SETTLED:
            return "already_settled"
        if child.state not in PENDING:
            return "invalid_transition"
        self._consume(parent, child, max(e["usage"].get("tokens", 0) - child.consumed, 0))
        self._settle(parent, child)
        return "ok"

    def _ParentClosed(self, e: dict) -> str:
        parent, err = self._parent(e)
        if err:
            return err
        if parent.status == "closing":
            return "invalid_transition"
        parent.status = "closing"
        parent.returned += parent.balances()["available"]
        for child in parent.children.values():
            if child.state in LIVE and not child.activated:
                parent.returned += child.remainder
                child.state = "released"
        self._finish(parent)
        return "ok"
