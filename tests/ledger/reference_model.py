"""A deliberately simple reference model of the ledger (SPEC §3-§10, §12), for the whole event vocabulary
of SPEC §4, borrowing (LoanRequested/LoanReturned, revocation) included.

It shares no code with the fold. Where the fold moves quantities between balance terms event by event, the
model keeps only per-child facts (reserved, consumed, consumed by earlier attempts, state, attempt,
generation, what awaits scheduler confirmation per physical dimension) plus the numbers that history alone
determines (returned_to_pool, overdrawn), and derives every balance term from them, per dimension:

    outstanding           = Σ remainder of live children (reserved, activated, partially_consumed, cancel_requested)
    pending               = Σ remainder of children in reconciliation (expired, reconciling, stranded)
    awaiting_confirmation = Σ children's released physical remainders not yet confirmed free
    committed             = Σ consumed of all children, including earlier attempts before a hand-off and
                            adjustments
    lent                  = Σ quantities of the loans not yet returned
    committed             (+ Σ what borrowers used of returned loans)
    available             = capacity + overdrawn - outstanding - pending - awaiting - lent - returned_to_pool
                            - committed

So a bookkeeping slip in the fold shows up as a different balance, not as the same slip twice. A child's
`reserved`/`consumed` count its current attempt alone: a retry hand-off (SPEC §4) moves what the old attempt
consumed into `before` and the remainder becomes the retry's `reserved` (the convention the fold's child
record uses; SPEC allows either).

Readings of SPEC that the model takes (each from the section named):
- §5 "Edge cases, decided": checks run parent, attempt, state, generation; a rejection changes nothing.
  A child in reconciliation refuses an outcome that leaves its usage unknown (`invalid_transition`) before
  any generation check.
- §8: closing or expiry sends `available` and the remainder of every child not activated by its current
  attempt to the pool at once; a child settling later on a fenced parent releases straight to the pool; the
  parent is `closed` once nothing is live, in reconciliation or awaiting confirmation. A retry hand-off needs
  an open parent (§4), else the child settles.
- Physical dimensions (§2, §3): a released physical remainder waits in `awaiting_confirmation` until
  `SchedulerReleaseConfirmed` of that child's attempt and dimension; the `CapacityReleased` is emitted then,
  to `parent` while the parent is open, else to `global_pool` (a confirmation of nothing awaiting:
  `invalid_transition`).
- §6: usage beyond what the child holds is drawn from `available`, the rest is `overdrawn` (result
  `overdrawn`); `UsageAdjustment` of a settled child draws all of it that way.
- §4 (out-of-order reports taken at their word): usage, a completion, a failure/ack with positive usage, and
  a `ChildFailed` saying `activated: true` (also with uncertain usage) prove the attempt ran; a later
  `ChildFailed` with `activated: false` and no usage for such a child is an uncertain outcome, not a
  release of all of R.
- §10: `duplicate`/`idempotency_conflict` come first (also for a closed parent); only applied events are
  stored; every release_key is unique.

Choices SPEC leaves open, taken from the fold (tests/ledger/test_transitions.py and processors/ledger/handlers.py,
accounting.py, fold.py):
- `invalid_event` for a malformed `CancelAcknowledged`/`ChildFailed` (usage and usage_uncertain both or
  neither -- a pre-activation failure may have neither --, a retry with uncertain usage or naming the
  failing attempt itself) comes before idempotency; a usage or quantities map naming a dimension the parent
  lacks is `invalid_event` once the child is looked up (after `unknown_child`, before the attempt check).
- A second `ParentReserved` for an existing, not closed parent: `invalid_transition`; a child id reserved twice:
  `invalid_transition` (before the dimension check). Fan-out counts live children only and is checked before
  `exceeds_available`.
- A second `CancelRequested` is `ok` (state stays `cancel_requested`). `CancelRequested` on a reserved child
  is `ok` and it stays never activated: an activation afterwards is `dispatch_fenced`, a skip is `ok`.
  `CancelAcknowledged` needs no earlier `CancelRequested`.
- `ChildActivated` of an activated child (same attempt): `invalid_transition`; of a settled (also
  `committed`) or reconciling child, whichever attempt: `dispatch_fenced`.
- `LeaseRenewed` before activation: `invalid_transition`. A renewal sets the deadline to now + TTL.
- `UsageReported` whose `usage_report_id` the attempt already counted: `duplicate_usage_report` (checked after
  the generation); report ids start afresh with a retry attempt.
- Implied activation does not start a lease; a report of a newer generation than granted on a live child
  adopts it (implied lease renewal), also a pre-activation failure's and an uncertain failure's or
  acknowledgement's (so that a late report of that generation can settle the child in reconciliation).
- `ChildFailed` with `activated: false`, no usage and a never-activated child: the child is settled with
  nothing consumed (all of R released; `committed` when it held nothing, as after a hand-off of nothing). A
  skip, a fence at close/expiry and a never-activated speculative loser always leave `released`.
- `SpeculativeWinner`: a winner that is no current attempt of the branch: `unknown_child`; a winner holding a
  stranded child: `invalid_transition` (§5's stranded row); naming the same winner again: `ok`, another one:
  `invalid_transition`. Activated live losers become `cancel_requested`; a never-activated loser is
  released at once (nothing ran, and it is fenced).
- `ReservationTransferred` only for a `reserved`, never-activated child (else `invalid_transition`); the
  lease generation stays.
- `ParentClosed` on a closing parent: `invalid_transition`; on an expired parent `ok` every time (the status
  stays `expired` until it closes).
- Borrowing (SPEC §9; docs/decisions.md 21): a loan's events must carry the loan's own keys
  (`parent_id/loan/<loan_id>/request|return`) and a loan must lend more than 0 of some dimension, else
  `invalid_event` (before idempotency). `LoanRequested` checks: parent open (else `parent_closed`), loan id
  new (`invalid_transition`), dimensions (`invalid_event`), at most 16 loans (`limit_exceeded`), a lending limit
  for every dimension named (`lending_not_allowed`), lent + q within it (`exceeds_lending_limit`), no loan
  being recalled (`awaiting_revocation`: siblings first), then `available` (`exceeds_available`).
  `LoanReturned`: parent not closed, loan known (`unknown_loan`), dimensions, loan open (`already_settled`);
  usage out of lent, beyond the loan from available then overdrawn; the remainder back (to the pool on a
  fenced parent), no scheduler confirmation. A `ChildReserved` beyond available that available + lent
  covers in every dimension: `awaiting_revocation`, asking back, newest first, the open loans not yet asked
  that hold some of a dimension still short, until the asked loans cover the shortfall; close and expiry ask
  back every open loan not yet asked; a parent closes only with no loan open.
- A Tick that does not move ledger time forward: `duplicate` if its key is the last applied tick's, else
  `stale_tick` (ticks are not in the idempotency store: same key, another `now_ms` ahead of ledger time is
  simply applied). Deadlines granted before a partition's first tick are rebased by that tick's time (ledger
  time 0 until then). Deadlines take effect when a tick reaches them (deadline <= now); a reconciliation
  deadline counts from the tick (or event) that sent the child to reconciliation.
"""

from __future__ import annotations

LIVE = frozenset({"reserved", "activated", "partially_consumed", "cancel_requested"})
RECON = frozenset({"expired", "reconciling", "stranded"})
SETTLED = frozenset({"committed", "released"})
HOLDING = LIVE | RECON
TERMS = ("capacity", "available", "outstanding", "pending", "awaiting_confirmation", "lent", "returned_to_pool",
         "committed", "overdrawn")
PARENT_DEST, POOL = "parent", "global_pool"


class Rejected(Exception):
    def __init__(self, code: str) -> None:
        self.code = code


class ModelChild:
    def __init__(self, branch: str, attempt: str, reserved: dict) -> None:
        self.branch = branch
        self.attempt = attempt
        self.reserved = dict(reserved)
        self.consumed: dict[str, int] = {}
        self.before: dict[str, int] = {}  # consumed by attempts that handed the child on
        self.awaiting: dict[str, int] = {}
        self.state = "reserved"
        self.activated = False  # by its current attempt
        self.generation = 0
        self.lease_deadline: int | None = None
        self.recon_deadline: int | None = None
        self.reports: set[str] = set()

    def remainder(self, dim: str) -> int:
        return max(self.reserved.get(dim, 0) - self.consumed.get(dim, 0), 0)

    def held(self, dim: str) -> int:
        return self.remainder(dim) if self.state in HOLDING else 0


class ModelLoan:
    def __init__(self, borrower: str, quantities: dict) -> None:
        self.borrower = borrower
        self.quantities = dict(quantities)
        self.open = True
        self.asked = False
        self.usage: dict[str, int] = {}


# Retention (decision 22): a parent closed this long ago in ledger time is compacted when a tick reaches
# closed_at + retention: its children, loans, balances and idempotency records are forgotten, it stays `closed`
# (late events: `parent_closed`, a redelivery no longer `duplicate`). None: never. The tests set it with the
# fold's (projections/model.py CLOSED_PARENT_RETENTION_MS) to reach it within their ticks.
RETENTION_MS: int | None = 7 * 24 * 3600 * 1000


class ModelParent:
    def __init__(self, capacity: dict, lease_deadline: int, policy: dict) -> None:
        self.lending_limit = dict(policy["lending_limit"])
        self.loans: dict[str, ModelLoan] = {}  # in the order lent
        self.capacity = {dim: spec["quantity"] for dim, spec in capacity.items()}
        self.kind = {dim: spec["kind"] for dim, spec in capacity.items()}
        self.lease_deadline = lease_deadline
        self.max_live = policy["max_live_children"]
        self.recon_timeout = policy["reconciliation_timeout_ms"]
        self.status = "open"
        self.outcome: str | None = None
        self.returned = {dim: 0 for dim in self.capacity}
        self.overdrawn = {dim: 0 for dim in self.capacity}
        self.children: dict[str, ModelChild] = {}
        self.winners: dict[str, str] = {}
        self.closed_at: int | None = None
        self.compacted = False

    def balance(self, dim: str) -> dict:
        kids = self.children.values()
        outstanding = sum(c.remainder(dim) for c in kids if c.state in LIVE)
        pending = sum(c.remainder(dim) for c in kids if c.state in RECON)
        awaiting = sum(c.awaiting.get(dim, 0) for c in kids)
        committed = sum(c.consumed.get(dim, 0) + c.before.get(dim, 0) for c in kids)
        committed += sum(loan.usage.get(dim, 0) for loan in self.loans.values())
        lent = sum(loan.quantities.get(dim, 0) for loan in self.loans.values() if loan.open)
        available = (self.capacity[dim] + self.overdrawn[dim] - outstanding - pending - awaiting
                     - lent - self.returned[dim] - committed)
        return {"capacity": self.capacity[dim], "available": available, "outstanding": outstanding,
                "pending": pending, "awaiting_confirmation": awaiting, "lent": lent,
                "returned_to_pool": self.returned[dim], "committed": committed, "overdrawn": self.overdrawn[dim]}

    def balances(self) -> dict:
        return {dim: self.balance(dim) for dim in sorted(self.capacity)}


class Model:
    def __init__(self) -> None:
        self.parents: dict[str, ModelParent] = {}
        self.applied: dict[tuple[str, str], dict] = {}
        self.now = 0
        self.ticked = False
        self.last_tick: str | None = None
        self.releases: list[tuple] = []
        self.revocations: list[tuple] = []  # (parent, loan) asked back by the last event
        self._overdrawn = False

    # -- entry --------------------------------------------------------------------------------------------

    def apply(self, e: dict) -> str:
        """The result code of `e`; `self.releases` lists what it released, as (parent, child, dim, q, dest)."""
        self.releases = []
        self.revocations = []
        self._overdrawn = False
        if e["type"] == "Tick":
            return self._tick(e)
        if self._malformed(e):
            return "invalid_event"
        ident = (e["parent_id"], e["idempotency_key"])
        payload = {k: v for k, v in e.items() if k not in ("event_id", "occurred_at_ms")}
        if ident in self.applied:
            return "duplicate" if self.applied[ident] == payload else "idempotency_conflict"
        try:
            getattr(self, "_" + e["type"])(e)
        except Rejected as rejection:
            # a rejection changes nothing: every handler checks before it changes
            assert not self.releases, (e, rejection.code)
            return rejection.code
        self.applied[ident] = payload
        return "overdrawn" if self._overdrawn else "ok"

    @staticmethod
    def _malformed(e: dict) -> bool:
        """What is meaningless whatever the ledger holds: `invalid_event`, before idempotency (as the fold)."""
        if e["type"] == "ParentClosed":
            return e["outcome"] not in ("succeeded", "failed", "cancelled")
        if e["type"] in ("LoanRequested", "LoanReturned"):
            verb = "request" if e["type"] == "LoanRequested" else "return"
            if e["idempotency_key"] != f"{e['parent_id']}/loan/{e['loan_id']}/{verb}":
                return True
            return e["type"] == "LoanRequested" and not any(q > 0 for q in e["quantities"].values())
        if e["type"] not in ("CancelAcknowledged", "ChildFailed"):
            return False
        uncertain, usage, retry = e["usage_uncertain"], e["usage"], e.get("retry_attempt_id")
        if uncertain and (usage is not None or retry is not None):
            return True
        if not uncertain and usage is None and (e["type"] == "CancelAcknowledged" or e["activated"]):
            return True
        return retry == e["attempt_id"]

    # -- time ---------------------------------------------------------------------------------------------

    def _tick(self, e: dict) -> str:
        now = e["now_ms"]
        if now <= self.now:
            return "duplicate" if e["idempotency_key"] == self.last_tick else "stale_tick"
        if not self.ticked:  # deadlines granted at ledger time 0 start at the first tick
            for parent in self.parents.values():
                parent.lease_deadline += now
                for child in parent.children.values():
                    if child.lease_deadline is not None:
                        child.lease_deadline += now
                    if child.recon_deadline is not None:
                        child.recon_deadline += now
                if parent.closed_at is not None:
                    parent.closed_at += now
        self.ticked, self.now, self.last_tick = True, now, e["idempotency_key"]
        for pid, parent in self.parents.items():
            if parent.status == "closed":
                if RETENTION_MS is not None and not parent.compacted and parent.closed_at + RETENTION_MS <= now:
                    self._compact(pid, parent)
                continue
            if parent.status == "open" and parent.lease_deadline <= now:
                parent.status = "expired"
                self._fence(pid, parent)
            for child in parent.children.values():
                if child.state in LIVE and child.lease_deadline is not None and child.lease_deadline <= now:
                    self._to_recon(parent, child)
                elif child.state in ("expired", "reconciling") and child.recon_deadline <= now:
                    child.state = "stranded"
                    child.recon_deadline = None
            self._maybe_close(parent)
        return "ok"

    # -- helpers ------------------------------------------------------------------------------------------

    def _parent(self, e: dict, open_only: bool = False) -> ModelParent:
        parent = self.parents.get(e["parent_id"])
        if parent is None:
            raise Rejected("unknown_parent")
        if parent.status == "closed" or (open_only and parent.status != "open"):
            raise Rejected("parent_closed")
        return parent

    def _child(self, e: dict, open_only: bool = False) -> tuple[ModelParent, ModelChild]:
        parent = self._parent(e, open_only)
        child = parent.children.get(e["child_id"])
        if child is None:
            raise Rejected("unknown_child")
        return parent, child

    @staticmethod
    def _valid_usage(parent: ModelParent, usage: dict | None) -> None:
        for dim, q in (usage or {}).items():
            if dim not in parent.capacity or q < 0:
                raise Rejected("invalid_event")

    def _held_child(self, e: dict, attempt_field: str = "attempt_id") -> tuple[ModelParent, ModelChild]:
        """Parent, attempt and the terminal states, in the order SPEC §5 checks them (a usage naming a
        dimension the parent lacks is `invalid_event`, once the child is found)."""
        parent, child = self._child(e)
        self._valid_usage(parent, e.get("usage"))
        if e[attempt_field] != child.attempt:
            raise Rejected("superseded_attempt")
        if child.state in SETTLED:
            raise Rejected("already_settled")
        if child.state == "stranded":
            raise Rejected("invalid_transition")
        return parent, child

    @staticmethod
    def _check_generation(child: ModelChild, generation: int) -> None:
        if generation < child.generation:
            raise Rejected("stale_lease_generation")
        if generation > child.generation and child.state in RECON:
            raise Rejected("invalid_transition")

    def _release(self, pid: str, parent: ModelParent, child_id: str, dim: str, quantity: int) -> None:
        if quantity <= 0:
            return
        if parent.status == "open":
            destination = PARENT_DEST  # the derived `available` grows by itself
        else:
            destination = POOL
            parent.returned[dim] += quantity
        self.releases.append((pid, child_id, dim, quantity, destination))

    def _consume(self, parent: ModelParent, child: ModelChild, usage: dict) -> None:
        """Commit `usage`: out of what the child holds, beyond it from `available`, the rest overdrawn."""
        for dim in sorted(usage):
            quantity = usage[dim]
            if quantity <= 0:
                continue
            excess = quantity - min(quantity, child.held(dim))
            if excess:
                short = max(excess - parent.balance(dim)["available"], 0)
                if short:
                    parent.overdrawn[dim] += short
                    self._overdrawn = True
            child.consumed[dim] = child.consumed.get(dim, 0) + quantity

    def _consume_total(self, parent: ModelParent, child: ModelChild, total: dict) -> None:
        """A settling event's usage is the attempt's total; what is already committed counts towards it."""
        self._consume(parent, child, {dim: q - child.consumed.get(dim, 0) for dim, q in total.items()})

    def _settle(self, pid: str, parent: ModelParent, cid: str, child: ModelChild, state: str | None = None) -> None:
        """Usage is committed; release what the child still holds (a physical remainder waits for the
        scheduler's confirmation). `committed` when nothing was left (C = R), else `released`, unless the
        transition names its state (a skip or a pre-activation failure is `released`, SPEC §5)."""
        left = {dim: child.held(dim) for dim in sorted(parent.capacity)}
        child.state = state or ("released" if any(left.values()) else "committed")
        child.lease_deadline = child.recon_deadline = None
        for dim, quantity in left.items():
            if quantity <= 0:
                continue
            if parent.kind[dim] == "physical":
                child.awaiting[dim] = child.awaiting.get(dim, 0) + quantity
            else:
                self._release(pid, parent, cid, dim, quantity)
        self._maybe_close(parent)

    def _hand_off(self, child: ModelChild, retry: str) -> None:
        for dim in set(child.reserved) | set(child.consumed):
            child.before[dim] = child.before.get(dim, 0) + child.consumed.get(dim, 0)
            child.reserved[dim] = child.remainder(dim)
            child.consumed[dim] = 0
        child.attempt = retry
        child.state = "reserved"
        child.activated = False
        child.generation += 1
        child.lease_deadline = child.recon_deadline = None
        child.reports = set()

    def _to_recon(self, parent: ModelParent, child: ModelChild) -> None:
        child.state = "reconciling"
        child.lease_deadline = None
        child.recon_deadline = self.now + parent.recon_timeout

    def _imply_activation(self, child: ModelChild, generation: int) -> None:
        child.generation = max(child.generation, generation)
        if not child.activated:
            child.activated = True
            if child.state == "reserved":
                child.state = "activated"

    def _fence(self, pid: str, parent: ModelParent) -> None:
        """Closing or expiry (SPEC §8): `available` and never-dispatched children go to the pool at once."""
        for dim in sorted(parent.capacity):
            self._release(pid, parent, "", dim, parent.balance(dim)["available"])
        for loan_id, loan in parent.loans.items():
            if loan.open and not loan.asked:
                self._ask_back(pid, loan_id, loan)
        for cid, child in parent.children.items():
            if child.state in LIVE and not child.activated:
                self._settle(pid, parent, cid, child, "released")

    def _maybe_close(self, parent: ModelParent) -> None:
        if parent.status in ("closing", "expired") and not any(
                c.state in HOLDING or any(c.awaiting.values()) for c in parent.children.values()) \
                and not any(loan.open for loan in parent.loans.values()):
            parent.status = "closed"
            parent.closed_at = self.now

    def _compact(self, pid: str, parent: ModelParent) -> None:
        parent.compacted = True
        parent.children, parent.loans, parent.winners = {}, {}, {}
        parent.capacity, parent.kind, parent.returned, parent.overdrawn = {}, {}, {}, {}
        for ident in [ident for ident in self.applied if ident[0] == pid]:
            del self.applied[ident]

    def _ask_back(self, pid: str, loan_id: str, loan: ModelLoan) -> None:
        assert not loan.asked, (pid, loan_id)
        loan.asked = True
        self.revocations.append((pid, loan_id))

    def _outcome(self, pid: str, parent: ModelParent, cid: str, child: ModelChild, e: dict) -> None:
        """A known outcome of a settling report: commit the total, then hand off to a retry or settle."""
        if any(q > 0 for q in e["usage"].values()):
            self._imply_activation(child, e["lease_generation"])
        else:
            child.generation = max(child.generation, e["lease_generation"])
        self._consume_total(parent, child, e["usage"])
        retry = e.get("retry_attempt_id")
        if retry and parent.status == "open":
            self._hand_off(child, retry)
        else:
            self._settle(pid, parent, cid, child)

    # -- events -------------------------------------------------------------------------------------------

    def _ParentReserved(self, e: dict) -> None:
        pid = e["parent_id"]
        if pid in self.parents:
            raise Rejected("parent_closed" if self.parents[pid].status == "closed" else "invalid_transition")
        if any(spec["kind"] not in ("logical", "physical") or spec["quantity"] < 0 for spec in e["capacity"].values()):
            raise Rejected("invalid_event")
        self.parents[pid] = ModelParent(e["capacity"], self.now + e["lease_ttl_ms"], e["policy"])

    def _ChildReserved(self, e: dict) -> None:
        parent = self._parent(e, open_only=True)
        if e["child_id"] in parent.children:
            raise Rejected("invalid_transition")
        self._valid_usage(parent, e["quantities"])
        if sum(c.state in LIVE for c in parent.children.values()) >= parent.max_live:
            raise Rejected("fanout_exceeded")
        balance = {dim: parent.balance(dim) for dim in e["quantities"]}
        short = {dim: q - balance[dim]["available"] for dim, q in e["quantities"].items()
                 if q > balance[dim]["available"]}
        if short and all(q <= balance[dim]["available"] + balance[dim]["lent"] for dim, q in e["quantities"].items()):
            self._recall(e["parent_id"], parent, short)
            raise Rejected("awaiting_revocation")
        if short:
            raise Rejected("exceeds_available")
        parent.children[e["child_id"]] = ModelChild(e["branch_id"], e["attempt_id"], e["quantities"])

    def _ChildActivated(self, e: dict) -> None:
        parent, child = self._child(e, open_only=True)
        if child.state in SETTLED or child.state in RECON:
            raise Rejected("dispatch_fenced")
        if e["attempt_id"] != child.attempt:
            raise Rejected("superseded_attempt")
        if child.activated:
            raise Rejected("invalid_transition")
        if child.state == "cancel_requested":
            raise Rejected("dispatch_fenced")
        if e["lease_generation"] < child.generation:
            raise Rejected("stale_lease_generation")
        child.activated, child.state, child.generation = True, "activated", e["lease_generation"]
        child.lease_deadline = self.now + e["lease_ttl_ms"]

    def _LeaseRenewed(self, e: dict) -> None:
        parent, child = self._held_child(e)
        if child.state in RECON or not child.activated:
            raise Rejected("invalid_transition")
        if e["lease_generation"] < child.generation:
            raise Rejected("stale_lease_generation")
        child.generation = e["lease_generation"]
        child.lease_deadline = self.now + e["lease_ttl_ms"]

    def _UsageReported(self, e: dict) -> None:
        parent, child = self._held_child(e)
        self._check_generation(child, e["lease_generation"])
        if e["usage_report_id"] in child.reports:
            raise Rejected("duplicate_usage_report")
        self._imply_activation(child, e["lease_generation"])
        child.reports.add(e["usage_report_id"])
        self._consume(parent, child, e["usage"])
        if e["final"]:
            self._settle(e["parent_id"], parent, e["child_id"], child)
        elif child.state == "activated":
            child.state = "partially_consumed"

    def _ChildCompleted(self, e: dict) -> None:
        parent, child = self._held_child(e)
        self._check_generation(child, e["lease_generation"])
        self._imply_activation(child, e["lease_generation"])
        self._consume_total(parent, child, e["usage"])
        self._settle(e["parent_id"], parent, e["child_id"], child)

    def _ChildSkipped(self, e: dict) -> None:
        parent, child = self._held_child(e)
        if child.state in RECON or child.activated:
            raise Rejected("invalid_transition")
        self._settle(e["parent_id"], parent, e["child_id"], child, "released")

    def _CancelRequested(self, e: dict) -> None:
        parent, child = self._held_child(e)
        if child.state in RECON:
            raise Rejected("invalid_transition")
        child.state = "cancel_requested"

    def _outcome_target(self, e: dict, uncertain) -> tuple[ModelParent, ModelChild]:
        """The checks of a CancelAcknowledged or ChildFailed, in SPEC's order (parent, attempt, state,
        generation); the shape of the event is checked last, as the fold does. `uncertain(child)`: whether
        the event leaves the usage unknown."""
        parent, child = self._held_child(e)
        if child.state in RECON and uncertain(child):
            raise Rejected("invalid_transition")
        self._check_generation(child, e["lease_generation"])
        return parent, child

    def _CancelAcknowledged(self, e: dict) -> None:
        parent, child = self._outcome_target(e, lambda child: e["usage_uncertain"])
        if e["usage_uncertain"]:
            child.generation = max(child.generation, e["lease_generation"])  # a late report of it may settle
            self._to_recon(parent, child)
        else:
            self._outcome(e["parent_id"], parent, e["child_id"], child, e)

    def _ChildFailed(self, e: dict) -> None:
        def uncertain(child: ModelChild) -> bool:
            # "before activation" from an executor the ledger saw dispatched proves nothing: reconciliation
            return e["usage_uncertain"] or (not e["activated"] and child.activated and e["usage"] is None)

        parent, child = self._outcome_target(e, uncertain)
        if e["activated"]:  # taken at its word (SPEC §4): the attempt ran, whatever else the ledger saw
            self._imply_activation(child, e["lease_generation"])
        else:
            child.generation = max(child.generation, e["lease_generation"])
        if uncertain(child):
            self._to_recon(parent, child)
        elif not e["activated"] and not child.activated and not e.get("retry_attempt_id") and not e["usage"]:
            child.generation = max(child.generation, e["lease_generation"])
            self._settle(e["parent_id"], parent, e["child_id"], child)  # before activation: all of R
        else:  # known usage
            self._outcome(e["parent_id"], parent, e["child_id"], child, dict(e, usage=e["usage"] or {}))

    def _SpeculativeWinner(self, e: dict) -> None:
        parent = self._parent(e)
        branch = {cid: c for cid, c in parent.children.items() if c.branch == e["branch_id"]}
        winners = [c for c in branch.values() if c.attempt == e["winner_attempt_id"]]
        if not winners:
            raise Rejected("unknown_child")
        if any(c.state == "stranded" for c in winners):  # a stranded child takes no event but a resolution
            raise Rejected("invalid_transition")
        if parent.winners.get(e["branch_id"], e["winner_attempt_id"]) != e["winner_attempt_id"]:
            raise Rejected("invalid_transition")
        parent.winners[e["branch_id"]] = e["winner_attempt_id"]
        for cid, child in branch.items():
            if child.attempt == e["winner_attempt_id"] or child.state not in LIVE:
                continue
            if child.activated:
                child.state = "cancel_requested"
            else:  # never dispatched, and now fenced: all of it returns
                self._settle(e["parent_id"], parent, cid, child, "released")

    def _ReservationTransferred(self, e: dict) -> None:
        parent, child = self._held_child(e, attempt_field="from_attempt_id")
        if child.state != "reserved" or child.activated:
            raise Rejected("invalid_transition")
        child.attempt = e["to_attempt_id"]
        child.reports = set()

    def _ReconciliationResolved(self, e: dict) -> None:
        parent, child = self._child(e)
        self._valid_usage(parent, e["usage"])
        if e["attempt_id"] != child.attempt:
            raise Rejected("superseded_attempt")
        if child.state in SETTLED:
            raise Rejected("already_settled")
        if child.state not in RECON:
            raise Rejected("invalid_transition")
        self._consume_total(parent, child, e["usage"])
        self._settle(e["parent_id"], parent, e["child_id"], child)

    def _UsageAdjustment(self, e: dict) -> None:
        parent, child = self._child(e)
        self._valid_usage(parent, e["usage"])
        if e["attempt_id"] != child.attempt:
            raise Rejected("superseded_attempt")
        if child.state not in SETTLED:
            raise Rejected("invalid_transition")
        self._consume(parent, child, e["usage"])

    def _SchedulerReleaseConfirmed(self, e: dict) -> None:
        parent, child = self._child(e)
        if e["attempt_id"] != child.attempt:
            raise Rejected("superseded_attempt")
        if child.state == "stranded" or not child.awaiting.get(e["dimension"]):
            raise Rejected("invalid_transition")
        quantity = child.awaiting.pop(e["dimension"])
        self._release(e["parent_id"], parent, e["child_id"], e["dimension"], quantity)
        self._maybe_close(parent)

    def _recall(self, pid: str, parent: ModelParent, short: dict) -> None:
        """Ask back the fewest newest loans needed: a loan (newest first, not yet asked) is asked when some
        dimension it holds is still short after every loan asked before, and the newer ones asked now."""
        open_loans = [(loan_id, loan) for loan_id, loan in parent.loans.items() if loan.open]
        covered = {dim: sum(loan.quantities.get(dim, 0) for _, loan in open_loans if loan.asked) for dim in short}
        for loan_id, loan in reversed(open_loans):
            if loan.asked:
                continue
            still_short = [dim for dim in short if covered[dim] < short[dim]]
            if not still_short:
                break
            if any(loan.quantities.get(dim, 0) > 0 for dim in still_short):
                self._ask_back(pid, loan_id, loan)
                for dim in short:
                    covered[dim] += loan.quantities.get(dim, 0)

    def _LoanRequested(self, e: dict) -> None:
        parent = self._parent(e, open_only=True)
        if e["loan_id"] in parent.loans:
            raise Rejected("invalid_transition")
        self._valid_usage(parent, e["quantities"])
        if len(parent.loans) >= 16:
            raise Rejected("limit_exceeded")
        if any(parent.lending_limit.get(dim, 0) <= 0 for dim in e["quantities"]):
            raise Rejected("lending_not_allowed")
        if any(parent.balance(dim)["lent"] + q > parent.lending_limit[dim] for dim, q in e["quantities"].items()):
            raise Rejected("exceeds_lending_limit")
        if any(loan.open and loan.asked for loan in parent.loans.values()):
            raise Rejected("awaiting_revocation")
        if any(q > parent.balance(dim)["available"] for dim, q in e["quantities"].items()):
            raise Rejected("exceeds_available")
        parent.loans[e["loan_id"]] = ModelLoan(e["borrower"], e["quantities"])

    def _LoanReturned(self, e: dict) -> None:
        parent = self._parent(e)
        loan = parent.loans.get(e["loan_id"])
        if loan is None:
            raise Rejected("unknown_loan")
        self._valid_usage(parent, e["usage"])
        if not loan.open:
            raise Rejected("already_settled")
        pid = e["parent_id"]
        for dim in sorted(set(loan.quantities) | set(e["usage"])):
            lent, used = loan.quantities.get(dim, 0), e["usage"].get(dim, 0)
            excess = max(used - lent, 0)
            short = max(excess - parent.balance(dim)["available"], 0)
            if short:
                parent.overdrawn[dim] += short
                self._overdrawn = True
        left = {dim: max(q - e["usage"].get(dim, 0), 0) for dim, q in loan.quantities.items()}
        loan.open = False
        loan.usage = {dim: q for dim, q in e["usage"].items() if q}
        for dim in sorted(left):
            self._release(pid, parent, "", dim, left[dim])
        self._maybe_close(parent)

    def _ParentClosed(self, e: dict) -> None:
        parent = self._parent(e)
        if e["outcome"] not in ("succeeded", "failed", "cancelled"):
            raise Rejected("invalid_event")
        if parent.status == "closing":
            raise Rejected("invalid_transition")
        parent.outcome = e["outcome"]
        if parent.status == "open":
            parent.status = "closing"
            self._fence(e["parent_id"], parent)
        self._maybe_close(parent)

    # -- reading ------------------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        snap = {}
        for pid, parent in self.parents.items():
            dims = sorted(parent.capacity)
            kids = {cid: (c.state, c.attempt, c.generation,
                          {d: c.consumed.get(d, 0) for d in dims},
                          {d: c.reserved.get(d, 0) - c.consumed.get(d, 0) for d in dims})
                    for cid, c in parent.children.items()}
            loans = {loan_id: (loan.open, loan.asked, dict(sorted(loan.usage.items())))
                     for loan_id, loan in parent.loans.items()}
            snap[pid] = (parent.status, parent.balances(), kids, loans)
        return snap
