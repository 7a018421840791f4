"""The ledger auditor: after every event, every balance term the fold keeps as a running sum is recomputed
from first principles and compared with what the fold stored, so a ledger whose invariant sum still holds
while its parts are wrong fails at the event that broke it, not many events later (or never).

From the children (projections/model.py `held_by_children`, their states and remainders):
    outstanding, pending, awaiting_confirmation; committed = Σ consumed, with what attempts that handed the
    child to a retry had consumed, plus what borrowers used of returned loans; the live- and open-children counts.
From the parent's loans: lent = Σ quantities of the open loans, within the lending limit; a loan asked back
    at most once (one LoanRevocationRequested per loan, ever) and returned at most once; an open loan of a
    closing or expired parent asked back; a closed parent with no loan open.
From the outputs the fold emitted (every one the auditor has seen):
    returned_to_pool = Σ releases to the global pool;
    per child and dimension, conservation: what it held before an event (its remainder where its state holds
    one, plus what awaits scheduler confirmation) is what it holds after, plus what the event released, plus at
    most what the event committed; so a child never releases more than it held;
    every release key once; a release to the parent only while the parent is open; a `ParentSettled` once,
    exactly when the parent becomes closed, and a closed parent holds nothing.
`available` then follows from the invariant, which the fold checks itself.

A parent or child the auditor did not see created (a ledger opened on a store it did not watch) gets the
checks that need no history, and the others from the next event on.

Used by the tests (tests/harness.py, the reference-model test, the bounded exhaustive check) and by the fault
simulation's reference fold (faults/sim.py). It reads the ledger through the same LedgerView as the fold and
changes nothing; `snapshot` and `restore` follow a fold that rewinds to its last checkpoint.
"""

from __future__ import annotations

import pickle

from branch_settlement.processors.ledger import results
from branch_settlement.processors.ledger.errors import LedgerAuditFailure
from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.projections import model
from branch_settlement.projections.view import LedgerView

class _Child:
    """What the auditor last saw of a child: per dimension what it held (its remainder where its state holds
    one, plus what awaits scheduler confirmation) and what all its attempts had consumed."""

    __slots__ = ("held", "consumed", "released", "reserved_first")

    def __init__(self, child: dict, new: bool) -> None:
        self.reserved_first = dict(child["reserved"]) if new else None  # None: created before the auditor
        self.held: dict[str, int] = dict(child["reserved"]) if new else _held(child)
        self.consumed: dict[str, int] = {} if new else model.consumed_by_all_attempts(child)
        self.released: dict[str, int] = {}


class LedgerAuditor:
    def __init__(self) -> None:
        self._children: dict[tuple[str, str], _Child] = {}
        self._pool: dict[tuple[str, str], int] = {}  # releases to the global pool per (parent, dimension)
        self._watched: set[str] = set()  # parents whose ParentReserved the auditor saw applied
        self._settled: set[str] = set()  # parents whose ParentSettled it saw
        self._release_keys: set[str] = set()
        self._revoked: set[tuple[str, str]] = set()  # (parent, loan) asked back
        self._returned: set[tuple[str, str]] = set()  # (parent, loan) whose return was applied

    def snapshot(self) -> bytes:
        """What the auditor knows, to `restore` when the fold rewinds to a checkpoint (pickled: a deep copy,
        and a compact one)."""
        return pickle.dumps((self._children, self._pool, self._watched, self._settled, self._release_keys,
                             self._revoked, self._returned), pickle.HIGHEST_PROTOCOL)

    def restore(self, snapshot: bytes) -> None:
        (self._children, self._pool, self._watched, self._settled, self._release_keys,
         self._revoked, self._returned) = pickle.loads(snapshot)

    def check(self, view: LedgerView, event: dict, result: dict, out: Outputs, start: tuple[int, ...]) -> None:
        """Audit the ledger after `event` (whose result is `result`), given the outputs it appended to `out`
        from the positions `start` (results, releases, audits, summaries and, if given, revocations). Raises
        LedgerAuditFailure."""
        releases = out.releases[start[1]:]
        audits = out.audits[start[2]:]
        settled = out.settled[start[3]:]
        where = f"after event {event['event_id']} ({event['type']}) at input offset {result['input_offset']}"
        if event["type"] == "ParentReserved" and result["result"] in results.APPLIED:
            self._watched.add(event["parent_id"])
        if event["type"] == "LoanReturned" and result["result"] in results.APPLIED:
            key = (event["parent_id"], event["loan_id"])
            if key in self._returned:
                raise LedgerAuditFailure(event["parent_id"], "*", f"loan {event['loan_id']!r} returned twice",
                                         event["event_id"], result["input_offset"])
            self._returned.add(key)
        touched = {event["parent_id"]} if event["parent_id"] else set()
        touched.update(record["parent_id"] for record in audits)
        touched.update(record["parent_id"] for record in releases)
        for record in releases:
            if record["release_key"] in self._release_keys:
                raise LedgerAuditFailure(record["parent_id"], record["dimension"],
                                         f"release key {record['release_key']!r} emitted twice", event["event_id"],
                                         result["input_offset"])
            self._release_keys.add(record["release_key"])
            if record["destination"] == model.DESTINATION_POOL:
                key = (record["parent_id"], record["dimension"])
                self._pool[key] = self._pool.get(key, 0) + record["quantity"]
        for summary in settled:
            if summary["parent_id"] in self._settled:
                raise LedgerAuditFailure(summary["parent_id"], "*", "ParentSettled emitted twice",
                                         event["event_id"], result["input_offset"])
            self._settled.add(summary["parent_id"])
        for record in out.revocations[start[4]:] if len(start) > 4 else ():
            key = (record["parent_id"], record["loan_id"])
            if key in self._revoked:
                raise LedgerAuditFailure(record["parent_id"], "*", f"loan {record['loan_id']!r} asked back twice",
                                         event["event_id"], result["input_offset"])
            self._revoked.add(key)
            touched.add(record["parent_id"])
        settled_now = {summary["parent_id"] for summary in settled}
        for parent_id in sorted(touched):
            parent = view.parent(parent_id)
            if parent is None:
                continue
            problems = self._parent_problems(view, parent, releases, settled_now, event, result)
            if problems:
                dim, detail = problems[0]
                raise LedgerAuditFailure(parent_id, dim, "; ".join(text for _, text in problems), event["event_id"],
                                         result["input_offset"], where)

    def _parent_problems(self, view: LedgerView, parent: dict, releases: list[dict], settled_now: set[str],
                         event: dict, result: dict) -> list[tuple[str, str]]:
        parent_id = parent["parent_id"]
        problems: list[tuple[str, str]] = []
        children = []
        for child_id in parent["children"]:
            child = view.child(parent_id, child_id)
            if child is None:
                problems.append(("*", f"child {child_id!r} is listed but has no record"))
                continue
            children.append(child)
        live = sum(child["state"] in model.LIVE_STATES for child in children)
        unsettled = sum(child["state"] not in model.SETTLED_STATES for child in children)
        if (parent["live_children"], parent["open_children"]) != (live, unsettled):
            problems.append(("*", f"live_children/open_children = {parent['live_children']}/"
                                  f"{parent['open_children']}, the children say {live}/{unsettled}"))
        child_releases: dict[tuple[str, str], int] = {}
        for record in releases:
            if record["parent_id"] != parent_id:
                continue
            if record["destination"] == model.DESTINATION_PARENT and parent["status"] != model.PARENT_OPEN:
                problems.append((record["dimension"], f"released {record['quantity']} to the parent, which is "
                                                      f"{parent['status']}"))
            if record["child_id"]:
                key = (record["child_id"], record["dimension"])
                child_releases[key] = child_releases.get(key, 0) + record["quantity"]
        watched = parent_id in self._watched
        committed = {dim: 0 for dim in parent["dimensions"]}
        for child in children:
            seen = self._children.get((parent_id, child["child_id"]))
            if seen is None:
                new = event["type"] == "ChildReserved" and event.get("child_id") == child["child_id"] \
                    and result["result"] in results.APPLIED
                seen = self._children[(parent_id, child["child_id"])] = _Child(child, watched and new)
            problems.extend(self._conservation(seen, child, child_releases))
            for dim, quantity in model.consumed_by_all_attempts(child).items():
                committed[dim] = committed.get(dim, 0) + quantity
        lent: dict[str, int] = {}
        if parent["loans"]:
            for dim, quantity in model.loan_usage(parent).items():
                committed[dim] = committed.get(dim, 0) + quantity
            lent = model.lent_by_loans(parent)
            problems.extend(self._loan_problems(parent, lent))
        derived = model.held_by_children(parent, children)
        for dim, balance in parent["dimensions"].items():
            expected = dict(derived[dim], committed=committed.get(dim, 0), lent=lent.get(dim, 0))
            if watched:  # needs the whole history of its releases
                expected["returned_to_pool"] = self._pool.get((parent_id, dim), 0)
            for term, quantity in expected.items():
                if balance[term] != quantity:
                    problems.append((dim, f"{term} = {balance[term]}, recomputed {quantity}"))
        problems.extend(self._closing_problems(parent, children, settled_now))
        return problems

    def _loan_problems(self, parent: dict, lent: dict[str, int]) -> list[tuple[str, str]]:
        parent_id = parent["parent_id"]
        problems = []
        for dim, quantity in lent.items():
            if quantity > parent["lending_limit"].get(dim, 0):
                problems.append((dim, f"lent {quantity} exceeds the lending limit "
                                      f"{parent['lending_limit'].get(dim, 0)}"))
        ids = [loan["loan_id"] for loan in parent["loans"]]
        if len(set(ids)) != len(ids):
            problems.append(("*", f"a loan id is listed twice: {ids}"))
        for loan in parent["loans"]:
            asked = (parent_id, loan["loan_id"]) in self._revoked
            if parent_id in self._watched and asked != loan["revocation_requested"]:
                problems.append(("*", f"loan {loan['loan_id']!r}: revocation_requested = "
                                      f"{loan['revocation_requested']}, but {'one' if asked else 'no'} "
                                      "LoanRevocationRequested was emitted"))
            if loan["state"] == model.LOAN_OPEN and parent["status"] != model.PARENT_OPEN \
                    and not loan["revocation_requested"]:
                problems.append(("*", f"loan {loan['loan_id']!r} is open on a {parent['status']} parent and was "
                                      "not asked back"))
        return problems

    @staticmethod
    def _conservation(seen: _Child, child: dict, child_releases: dict[tuple[str, str], int]) -> list[tuple[str, str]]:
        """What the child held before the event = what it holds now + what the event released from it + at most
        what the event committed of it."""
        consumed_now = model.consumed_by_all_attempts(child)
        held_now = _held(child)
        child_id = child["child_id"]
        problems = []
        dims = set(seen.held) | set(held_now) | {dim for cid, dim in child_releases if cid == child_id}
        for dim in sorted(dims):
            released = child_releases.get((child_id, dim), 0)
            before, after = seen.held.get(dim, 0), held_now.get(dim, 0) + released
            drawn = consumed_now.get(dim, 0) - seen.consumed.get(dim, 0)
            if after > before:
                problems.append((dim, f"child {child_id!r} held {before}, now holds {held_now.get(dim, 0)} and "
                                      f"released {released}: more than it held"))
            elif before - after > drawn:
                problems.append((dim, f"child {child_id!r} held {before}, now holds {held_now.get(dim, 0)}, "
                                      f"released {released} and committed {drawn}: {before - after - drawn} "
                                      "went nowhere"))
            seen.released[dim] = seen.released.get(dim, 0) + released
            if seen.reserved_first is not None and seen.released[dim] > seen.reserved_first.get(dim, 0):
                problems.append((dim, f"child {child_id!r} released {seen.released[dim]} in all, more than its "
                                      f"reservation of {seen.reserved_first.get(dim, 0)}"))
        seen.held, seen.consumed = held_now, consumed_now
        return problems

    def _closing_problems(self, parent: dict, children: list[dict], settled_now: set[str]) -> list[tuple[str, str]]:
        parent_id = parent["parent_id"]
        problems = []
        if parent["status"] == model.PARENT_CLOSED:
            open_children = [child["child_id"] for child in children if child["state"] not in model.SETTLED_STATES]
            if open_children:
                problems.append(("*", f"closed with children not settled: {', '.join(open_children)}"))
            open_loans = [loan["loan_id"] for loan in model.open_loans(parent)]
            if open_loans:
                problems.append(("*", f"closed with loans open: {', '.join(open_loans)}"))
            for dim, balance in parent["dimensions"].items():
                for term in ("outstanding", "pending", "awaiting_confirmation", "lent", "available"):
                    if balance[term]:
                        problems.append((dim, f"closed with {term} = {balance[term]}"))
            if parent_id in self._watched and parent_id not in self._settled:
                problems.append(("*", "closed without a ParentSettled"))
        elif parent_id in settled_now:
            problems.append(("*", f"ParentSettled emitted while the parent is {parent['status']}"))
        return problems


def _held(child: dict) -> dict[str, int]:
    term = model.holding_term(child["state"])
    dims = set(child["reserved"]) | set(child["awaiting"])
    return {dim: (model.remainder(child, dim) if term else 0) + child["awaiting"].get(dim, 0) for dim in dims}


class AuditedFold(Fold):
    """The fold with the ledger auditor run after every event (tests and simulations: it costs a recount of
    the touched parents' children per event)."""

    def __init__(self, view: LedgerView, partition: int = 0, auditor: LedgerAuditor | None = None,
                 partitions: int | None = None, implementation: str | None = None) -> None:
        super().__init__(view, partition, partitions, implementation)
        self.auditor = auditor if auditor is not None else LedgerAuditor()

    def apply(self, event: dict, offset: int, out: Outputs, ledger_tick: bool = False) -> dict:
        start = (len(out.results), len(out.releases), len(out.audits), len(out.settled), len(out.revocations))
        result = super().apply(event, offset, out, ledger_tick)
        self.auditor.check(self.view, event, result, out, start)
        return result
