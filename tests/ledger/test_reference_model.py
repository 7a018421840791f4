"""The fold against the reference model (tests/ledger/reference_model.py), event by event, over seeded random
streams of the whole event vocabulary of SPEC §4, borrowing included: several parents with a logical (`tokens`)
and a physical (`gpus`) dimension, short parent leases, closes while children are live, reconciling or
awaiting confirmation, retries with and without `retry_attempt_id` from every state, speculative copies,
transfers, adjustments, scheduler confirmations (right and wrong), overruns, late reports, stale generations,
loans within and beyond a lending limit (or none), returns with usage within and beyond the loan, sibling
reservations that recall loans, closes and expiries with loans open,
superseded attempts, duplicates and idempotency conflicts of every event type, adjacent reordering, ticks
crossing lease and reconciliation deadlines, and crashes of the store between checkpoints.

After every event the result code, every balance term of every dimension and the status of every parent, each
child's state, attempt, generation, consumed and remainder, each loan's state, revocation and usage, and the
releases and revocations the event emitted are compared.
Any failure names the seed that reproduces it: `pytest tests/ledger/test_reference_model.py -k 'seed-1234'`."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from branch_settlement.processors.ledger.auditor import AuditedFold, LedgerAuditor
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.replay.replayer import open_view
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas.codec import default_codec
from tests.ledger.reference_model import TERMS, Model

pytestmark = pytest.mark.unit

T0 = 1_764_410_400_000


class Stream:
    """Builds a plausible but adversarial event stream from a seed.

    It aims with a model of its own (the events so far, in the order it emits them): most events target a
    child in a state where they mean something (a hand-off from every live and reconciling state, a
    confirmation of what awaits), the rest are deliberately off (superseded or unknown attempts, stale or
    newer generations, settled or unknown children, closed parents). Redeliveries, idempotency conflicts and
    adjacent reordering are applied on top, so the model aims at the intended order, not the delivered one."""

    def __init__(self, seed: int, length: int) -> None:
        self.rng = random.Random(seed)
        self.length = length
        self.now = T0
        self.events: list[dict] = []
        self.aim = Model()
        self.parents: list[str] = []
        self.ids: list[tuple[str, str]] = []  # every child id sent, applied or not
        self.attempts: dict[tuple[str, str], list[str]] = {}
        self.loan_ids: list[tuple[str, str]] = []  # every loan id requested, lent or not
        self.n = 0

    # -- emitting -----------------------------------------------------------------------------------------

    def emit(self, etype: str, parent_id: str, key: str | None = None, **fields) -> None:
        self.n += 1
        if key is None:
            if "child_id" in fields:
                attempt = fields.get("attempt_id") or fields.get("from_attempt_id")
                key = f"{parent_id}/{fields['child_id']}/{attempt}/{self.n}"
            else:
                key = f"{parent_id}/{etype}/{self.n}"
        self.push({"type": etype, "event_id": f"e{self.n}", "idempotency_key": key, "parent_id": parent_id,
                   "occurred_at_ms": self.now, **fields})

    def push(self, event: dict) -> None:
        self.events.append(event)
        self.aim.apply(self.codec.event_from_json(event))

    def build(self) -> list[dict]:
        rng = self.rng
        self.codec = default_codec()
        if rng.random() < 0.15:  # leases granted before the partition's first tick
            self.open_parent()
            for _ in range(rng.randint(0, 3)):
                rng.choice([self.reserve, self.activate, self.activate])()
        self.tick()
        for _ in range(rng.randint(1, 3)):
            self.open_parent()
        ops = [(self.reserve, 10), (self.retry_new_child, 2), (self.activate, 10), (self.renew, 3),
               (self.usage_report, 10), (self.complete, 5), (self.skip, 2), (self.cancel, 4), (self.ack, 5),
               (self.fail, 6), (self.winner, 2), (self.transfer, 2), (self.resolve, 3), (self.adjust, 2),
               (self.confirm, 5), (self.tick, 9), (self.close, 1.2), (self.duplicate, 5), (self.conflict, 4),
               (self.open_more, 0.7), (self.invalid, 0.4), (self.lend, 5), (self.return_loan, 4)]
        actions, weights = zip(*ops)
        while len(self.events) < self.length:
            if sum(p.status == "open" for p in self.aim.parents.values()) == 0 and rng.random() < 0.3:
                self.open_parent()
            rng.choices(actions, weights)[0]()
        for i in range(len(self.events) - 1):  # reordered deliveries
            if rng.random() < 0.05:
                self.events[i], self.events[i + 1] = self.events[i + 1], self.events[i]
        return [self.codec.event_from_json(e) for e in self.events]

    # -- aiming -------------------------------------------------------------------------------------------

    def pick(self, *states: str, awaiting: bool = False):
        """(parent_id, child_id, child or None): mostly a child in one of `states`, else any id sent."""
        rng = self.rng
        if rng.random() < 0.88:
            fits = [(pid, cid, c) for pid, p in self.aim.parents.items() if p.status != "closed"
                    for cid, c in p.children.items()
                    if c.state in states or (awaiting and any(c.awaiting.values()))]
            if fits:
                return rng.choice(fits)
        if not self.ids:
            return None
        pid, cid = rng.choice(self.ids)
        parent = self.aim.parents.get(pid)
        return pid, cid, parent.children.get(cid) if parent else None

    def attempt(self, pid: str, cid: str, child) -> str:
        roll = self.rng.random()
        old = self.attempts.get((pid, cid), [])
        if roll < 0.06 and len(old) > 1:
            return self.rng.choice(old[:-1])  # a late event of a superseded attempt
        if roll < 0.08 or child is None:
            return old[-1] if old and child is None else f"{cid}.x"
        return child.attempt

    def gen(self, child, fresh: bool = False) -> int:
        g = child.generation if child is not None else 0
        if fresh and g == 0:
            g = 1
        roll = self.rng.random()
        if roll < 0.07:
            return max(g - 1, 0)  # a superseded lease holder
        if roll < 0.11:
            return g + 1  # a generation the ledger never granted
        return g

    def new_attempt(self, pid: str, cid: str) -> str:
        old = self.attempts.setdefault((pid, cid), [])
        attempt = f"{cid}.{len(old) + 1}"
        old.append(attempt)
        return attempt

    def amounts(self, most: int) -> dict:
        usage = {"tokens": self.rng.randint(0, most)}
        if self.rng.random() < 0.35:
            usage["gpus"] = self.rng.randint(0, 2)
        if self.rng.random() < 0.1:
            del usage["tokens"]
        return usage

    # -- events -------------------------------------------------------------------------------------------

    def open_parent(self, parent_id: str | None = None) -> None:
        rng = self.rng
        parent_id = parent_id or f"P{len(self.parents)}"
        if parent_id not in self.parents:
            self.parents.append(parent_id)
        short = rng.random() < 0.45
        self.emit("ParentReserved", parent_id,
                  capacity={"tokens": {"quantity": rng.randint(60, 250), "kind": "logical"},
                            "gpus": {"quantity": rng.randint(2, 12), "kind": "physical"}},
                  lease_ttl_ms=rng.randint(200_000, 1_500_000) if short else 10**12,
                  policy={"max_live_children": rng.randint(2, 7),
                          "reconciliation_timeout_ms": rng.randint(20_000, 400_000),
                          "lending_limit": self.lending_limit()})

    def lending_limit(self) -> dict:
        roll = self.rng.random()
        if roll < 0.3:
            return {}
        limit = {"tokens": self.rng.randint(10, 120)}
        if roll < 0.6:
            limit["gpus"] = self.rng.randint(1, 4)
        return limit

    def lend(self) -> None:
        rng = self.rng
        parent_id = self.live_parent()
        if parent_id is None:
            return
        if rng.random() < 0.1 and self.loan_ids:
            parent_id, loan_id = rng.choice(self.loan_ids)  # a loan id in use (or rejected before)
        else:
            loan_id = f"L{self.n}"
            self.loan_ids.append((parent_id, loan_id))
        quantities = {"tokens": rng.randint(0, 60)}
        if rng.random() < 0.4:
            quantities["gpus"] = rng.randint(0, 3)
        if rng.random() < 0.1:
            del quantities["tokens"]
            quantities["gpus"] = rng.randint(0, 2)
        key = f"{parent_id}/loan/{loan_id}/request"
        if rng.random() < 0.03:
            key += "-wrong"
        self.emit("LoanRequested", parent_id, key=key, loan_id=loan_id, borrower=f"w{rng.randint(1, 3)}",
                  quantities=quantities)

    def return_loan(self) -> None:
        rng = self.rng
        open_loans = [(pid, loan_id, loan) for pid, p in self.aim.parents.items() if p.status != "closed"
                      for loan_id, loan in p.loans.items() if loan.open]
        if open_loans and rng.random() < 0.85:
            asked = [t for t in open_loans if t[2].asked]
            pid, loan_id, loan = rng.choice(asked if asked and rng.random() < 0.6 else open_loans)
        elif self.loan_ids:
            pid, loan_id = rng.choice(self.loan_ids)
            parent = self.aim.parents.get(pid)
            loan = parent.loans.get(loan_id) if parent else None
        else:
            return
        most = (loan.quantities.get("tokens", 0) if loan else 10) + (15 if rng.random() < 0.2 else 0)
        usage = {"tokens": rng.randint(0, most)}
        if rng.random() < 0.3:
            usage["gpus"] = rng.randint(0, 2)
        self.emit("LoanReturned", pid, key=f"{pid}/loan/{loan_id}/return", loan_id=loan_id, usage=usage)

    def open_more(self) -> None:
        if self.rng.random() < 0.2 and self.parents:
            self.open_parent(self.rng.choice(self.parents))  # an id in use, or closed
        else:
            self.open_parent()

    def live_parent(self) -> str | None:
        open_ = [pid for pid, p in self.aim.parents.items() if p.status == "open"]
        if open_ and self.rng.random() < 0.92:
            return self.rng.choice(open_)
        return self.rng.choice(self.parents) if self.parents else None

    def reserve(self, branch: str | None = None, parent_id: str | None = None) -> None:
        rng = self.rng
        parent_id = parent_id or self.live_parent()
        if parent_id is None:
            return
        child = f"c{self.n}"
        if branch is None and rng.random() < 0.25:  # a speculative copy of a branch
            parent = self.aim.parents.get(parent_id)
            same = sorted({c.branch for c in parent.children.values()}) if parent else []
            branch = rng.choice(same) if same else None
        self.ids.append((parent_id, child))
        quantities = {"tokens": rng.randint(1, 50)}
        if rng.random() < 0.75:
            quantities["gpus"] = rng.randint(0, 3)
        self.emit("ChildReserved", parent_id, child_id=child, branch_id=branch or f"b{self.n}",
                  attempt_id=self.new_attempt(parent_id, child), quantities=quantities)

    def retry_new_child(self) -> None:
        """A retry without `retry_attempt_id`: a new child of the same branch, from `available`."""
        if target := self.pick("released", "committed", "reconciling", "stranded"):
            pid, cid, child = target
            self.reserve(branch=child.branch if child else None, parent_id=pid)

    def activate(self) -> None:
        if target := self.pick("reserved", "reserved", "cancel_requested"):
            pid, cid, child = target
            self.emit("ChildActivated", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                      lease_generation=self.gen(child, fresh=True), lease_ttl_ms=self.rng.randint(20_000, 250_000))

    def renew(self) -> None:
        if target := self.pick("activated", "partially_consumed", "cancel_requested"):
            pid, cid, child = target
            generation = self.gen(child) + (self.rng.random() < 0.25)  # sometimes a new holder
            self.emit("LeaseRenewed", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                      lease_generation=generation, lease_ttl_ms=self.rng.randint(20_000, 250_000))

    def usage_report(self) -> None:
        if target := self.pick("activated", "partially_consumed", "cancel_requested", "reconciling", "reserved"):
            pid, cid, child = target
            self.emit("UsageReported", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                      lease_generation=self.gen(child), usage_report_id=f"r{self.rng.randint(0, 6)}",
                      usage=self.amounts(25), final=self.rng.random() < 0.25)

    def complete(self) -> None:
        if target := self.pick("activated", "partially_consumed", "cancel_requested", "reconciling"):
            pid, cid, child = target
            self.emit("ChildCompleted", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                      lease_generation=self.gen(child), usage=self.amounts(60))

    def skip(self) -> None:
        if target := self.pick("reserved", "cancel_requested"):
            pid, cid, child = target
            self.emit("ChildSkipped", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child), reason="not needed")

    def cancel(self) -> None:
        if target := self.pick("activated", "partially_consumed", "reserved", "cancel_requested"):
            pid, cid, child = target
            self.emit("CancelRequested", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child), reason="user")

    def outcome(self, etype: str, **extra) -> None:
        """A CancelAcknowledged or ChildFailed: known usage (maybe handing the rest to a retry) or uncertain."""
        target = self.pick("reserved", "activated", "partially_consumed", "cancel_requested", "reconciling")
        if not target:
            return
        pid, cid, child = target
        fields = dict(child_id=cid, attempt_id=self.attempt(pid, cid, child), lease_generation=self.gen(child))
        if self.rng.random() < 0.25:
            fields["usage_uncertain"] = True
        else:
            fields["usage"] = self.amounts(40)
            if self.rng.random() < 0.5:
                fields["retry_attempt_id"] = self.new_attempt(pid, cid)
        self.emit(etype, pid, **fields, **extra)

    def ack(self) -> None:
        self.outcome("CancelAcknowledged")

    def fail(self) -> None:
        if self.rng.random() < 0.2:  # before activation, as the executor saw it
            if target := self.pick("reserved", "cancel_requested", "activated"):
                pid, cid, child = target
                fields = {}
                if self.rng.random() < 0.3:
                    fields["retry_attempt_id"] = self.new_attempt(pid, cid)
                    fields["usage"] = {}
                self.emit("ChildFailed", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                          lease_generation=self.gen(child), activated=False, reason="never started", **fields)
        else:
            self.outcome("ChildFailed", activated=True, reason="worker lost")

    def winner(self) -> None:
        if target := self.pick("reserved", "activated", "partially_consumed", "cancel_requested", "released"):
            pid, cid, child = target
            parent = self.aim.parents.get(pid)
            if child is None or parent is None:
                return
            copies = [c.attempt for c in parent.children.values() if c.branch == child.branch]
            winner = self.rng.choice(copies) if self.rng.random() < 0.9 else f"{child.branch}.none"
            self.emit("SpeculativeWinner", pid, branch_id=child.branch, winner_attempt_id=winner)

    def transfer(self) -> None:
        if target := self.pick("reserved", "reserved", "activated", "cancel_requested"):
            pid, cid, child = target
            self.emit("ReservationTransferred", pid, child_id=cid, from_attempt_id=self.attempt(pid, cid, child),
                      to_attempt_id=self.new_attempt(pid, cid))

    def resolve(self) -> None:
        if target := self.pick("reconciling", "stranded"):
            pid, cid, child = target
            self.emit("ReconciliationResolved", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                      usage=self.amounts(60), resolution=self.rng.choice(["late_report", "operator"]))

    def adjust(self) -> None:
        if target := self.pick("released", "committed"):
            pid, cid, child = target
            self.emit("UsageAdjustment", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                      usage=self.amounts(12), reason="late invoice")

    def confirm(self) -> None:
        if target := self.pick("released", "committed", awaiting=True):
            pid, cid, child = target
            dim = "gpus" if self.rng.random() < 0.85 else "tokens"
            self.emit("SchedulerReleaseConfirmed", pid, child_id=cid, attempt_id=self.attempt(pid, cid, child),
                      dimension=dim)

    def tick(self) -> None:
        self.now += self.rng.choice([self.rng.randint(1_000, 60_000), self.rng.randint(60_000, 300_000)])
        self.emit("Tick", "", key=f"tick/0/{self.now}", now_ms=self.now)

    def close(self) -> None:
        if parent_id := self.live_parent():
            self.emit("ParentClosed", parent_id, outcome=self.rng.choice(["succeeded", "failed", "cancelled"]))

    def duplicate(self) -> None:
        """A redelivery: same key, same payload, new event id (and delivery time)."""
        if self.events:
            self.n += 1
            self.push(dict(self.rng.choice(self.events[-40:]), event_id=f"e{self.n}", occurred_at_ms=self.now + 1))

    def conflict(self) -> None:
        """Same key, another payload, for any event type."""
        if not self.events:
            return
        e = dict(self.rng.choice(self.events[-60:]))
        t = e["type"]
        if t == "Tick":
            e["now_ms"] = self.now + self.rng.randint(1, 50_000)
        elif t == "ParentReserved":
            e["capacity"] = {**e["capacity"], "tokens": {"quantity": e["capacity"]["tokens"]["quantity"] + 1,
                                                         "kind": "logical"}}
        elif t == "ChildReserved":
            e["quantities"] = {**e["quantities"], "tokens": e["quantities"]["tokens"] + 1}
        elif t in ("ChildActivated", "LeaseRenewed"):
            e["lease_ttl_ms"] += 1
        elif t == "UsageReported":
            e["final"] = not e.get("final", False)
        elif t in ("ChildCompleted", "ReconciliationResolved", "UsageAdjustment"):
            e["usage"] = {**e["usage"], "tokens": e["usage"].get("tokens", 0) + 1}
        elif t in ("ChildSkipped", "CancelRequested"):
            e["reason"] = "other"
        elif t in ("CancelAcknowledged", "ChildFailed"):
            if e.get("usage") is not None:
                e["usage"] = {**e["usage"], "tokens": e["usage"].get("tokens", 0) + 1}
            else:
                e["lease_generation"] = e["lease_generation"] + 1
        elif t == "SpeculativeWinner":
            e["winner_attempt_id"] += "-other"
        elif t == "ReservationTransferred":
            e["to_attempt_id"] += "-other"
        elif t == "SchedulerReleaseConfirmed":
            e["dimension"] = "tokens" if e["dimension"] == "gpus" else "gpus"
        elif t == "ParentClosed":
            e["outcome"] = "failed" if e["outcome"] != "failed" else "cancelled"
        elif t == "LoanRequested":
            e["borrower"] += "-other"
        elif t == "LoanReturned":
            e["usage"] = {**e["usage"], "tokens": e["usage"].get("tokens", 0) + 1}
        self.n += 1
        e["event_id"] = f"e{self.n}"
        self.push(e)

    def invalid(self) -> None:
        if target := self.pick("activated", "partially_consumed", "cancel_requested"):
            pid, cid, child = target
            attempt = self.attempt(pid, cid, child)
            if self.rng.random() < 0.5:
                self.emit("CancelAcknowledged", pid, child_id=cid, attempt_id=attempt, lease_generation=self.gen(child))
            else:
                self.emit("UsageReported", pid, child_id=cid, attempt_id=attempt, lease_generation=self.gen(child),
                          usage_report_id="bad", usage={"cpu": 1})


def expected(events: list[dict], label: str) -> tuple[list[str], list, list, list]:
    """The model's result, ledger snapshot, releases and revocations per event."""
    model = Model()
    codes, snapshots, releases, revocations = [], [], [], []
    for i, event in enumerate(events):
        codes.append(model.apply(event))
        snapshot = model.snapshot()
        for pid, (_, balances, _, _) in snapshot.items():  # SPEC §3 holds in the model by construction, or it is wrong
            for dim, b in balances.items():
                assert min(b.values()) >= 0, f"{label}, event {i}: the MODEL broke SPEC §3 on {pid}/{dim}: {b}"
        snapshots.append(snapshot)
        releases.append(sorted(model.releases))
        revocations.append(list(model.revocations))
    return codes, snapshots, releases, revocations


def observed(view, want: dict) -> dict:
    snapshot = {}
    for pid in want:
        parent = view.parent(pid)
        if parent is None:
            snapshot[pid] = None
            continue
        dims = sorted(parent["dimensions"])
        balances = {dim: {t: parent["dimensions"][dim][t] for t in TERMS} for dim in dims}
        kids = {}
        for cid in parent["children"]:
            c = view.child(pid, cid)
            kids[cid] = (c["state"], c["attempt_id"], c["lease_generation"],
                         {d: c["consumed"].get(d, 0) for d in dims},
                         {d: c["reserved"].get(d, 0) - c["consumed"].get(d, 0) for d in dims})
        loans = {loan["loan_id"]: (loan["state"] == "open", loan["revocation_requested"], loan["usage"])
                 for loan in parent["loans"]}
        snapshot[pid] = (parent["status"], balances, kids, loans)
    return snapshot


def describe(got: dict, want: dict) -> str:
    lines = []
    for pid in sorted(set(got) | set(want)):
        g, w = got.get(pid), want.get(pid)
        if g == w:
            continue
        if g is None or w is None:
            lines.append(f"  {pid}: fold {g}\n  {pid}: model {w}")
            continue
        if g[0] != w[0]:
            lines.append(f"  {pid} status: fold {g[0]} model {w[0]}")
        for dim in sorted(set(g[1]) | set(w[1])):
            if g[1].get(dim) != w[1].get(dim):
                lines.append(f"  {pid} {dim}: fold  {g[1].get(dim)}\n  {pid} {dim}: model {w[1].get(dim)}")
        for cid in sorted(set(g[2]) | set(w[2])):
            if g[2].get(cid) != w[2].get(cid):
                lines.append(f"  {pid}/{cid}: fold  {g[2].get(cid)}\n  {pid}/{cid}: model {w[2].get(cid)}")
        if g[3] != w[3]:
            lines.append(f"  {pid} loans: fold  {g[3]}\n  {pid} loans: model {w[3]}")
    return "\n".join(lines)


def by_parent(asked: list[tuple]) -> list[tuple]:
    """(parent, loan) pairs grouped by parent, each parent's in its own order (a stable sort)."""
    return sorted(asked, key=lambda pair: pair[0])


def check_events(events: list[dict], label: str, chaos_seed: int | None = None) -> None:
    """Fold `events` and compare with the model after every event; with `chaos_seed`, checkpoint and crash
    the store at random between events (a crash resumes from the last checkpoint)."""
    codes, snapshots, releases, revocations = expected(events, label)
    codec = default_codec()
    store = MemoryStore()
    chaos = random.Random(chaos_seed) if chaos_seed is not None else None
    auditor = LedgerAuditor()  # every balance term recomputed after every event, too
    fold = AuditedFold(open_view(store, codec), auditor=auditor)
    audited = auditor.snapshot()
    committed, batch = Outputs(), Outputs()
    resume_at, i, crashes = 0, 0, 0
    while i < len(events):
        before, asked_before = len(batch.releases), len(batch.revocations)
        result = fold.apply(events[i], i, batch)
        where = f"{label}, event {i}: {events[i]}"
        assert result["result"] == codes[i], f"{where}\nfold: {result['result']} {result['detail']}, model: {codes[i]}"
        got_releases = sorted((r["parent_id"], r["child_id"] or "", r["dimension"], r["quantity"], r["destination"])
                              for r in batch.releases[before:])
        assert got_releases == releases[i], f"{where}\nreleases: fold {got_releases}\n          model {releases[i]}"
        # Within a parent, loans are asked back newest first (SPEC §9); across parents a tick fires its timers
        # in deadline order, which the model does not track: it visits parents in the order they were reserved.
        # So each parent's own order is compared, and the order between parents is pinned by
        # test_a_tick_fires_its_timers_in_deadline_order_across_parents.
        got_asked = by_parent([(r["parent_id"], r["loan_id"]) for r in batch.revocations[asked_before:]])
        want_asked = by_parent(revocations[i])
        assert got_asked == want_asked, f"{where}\nrevocations: fold {got_asked}\n             model {want_asked}"
        got = observed(fold.view, snapshots[i])
        assert got == snapshots[i], f"{where}\n{describe(got, snapshots[i])}"
        i += 1
        roll = chaos.random() if chaos else 1.0
        if roll < 0.1:  # checkpoint: outputs and state become durable together
            store.write(fold.view.changes(), i - 1)
            fold.view.mark_committed()
            committed.extend(batch)
            batch, resume_at, audited = Outputs(), i, auditor.snapshot()
        elif roll < 0.13:  # crash: everything since the last checkpoint is lost; resume from there
            auditor.restore(audited)
            fold = AuditedFold(open_view(store, codec), auditor=auditor)
            batch, i, crashes = Outputs(), resume_at, crashes + 1
    committed.extend(batch)
    assert [r["result"] for r in committed.results] == codes, f"{label}: committed results differ"
    assert [r["input_offset"] for r in committed.results] == list(range(len(events))), label
    keys = [r["release_key"] for r in committed.releases]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    assert not twice, f"{label}: release keys emitted more than once (SPEC §10): {twice}"
    asked = [r["revocation_key"] for r in committed.revocations]
    assert len(asked) == len(set(asked)), f"{label}: a loan was asked back twice (SPEC §9)"


def check_seed(seed: int, length: int = 400) -> None:
    check_events(Stream(seed, length).build(), f"seed {seed}", chaos_seed=seed ^ 0x5EED)


@pytest.mark.parametrize("seed", range(150), ids=lambda s: f"seed-{s}")
def test_fold_matches_model(seed: int) -> None:
    check_seed(seed)


@pytest.mark.parametrize("seed", range(1000, 1040), ids=lambda s: f"seed-{s}")
def test_fold_matches_model_with_a_short_retention(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention (decision 22) within the streams' ledger time: closed parents are compacted by later ticks, and
    the events that follow (redeliveries, late reports, a ParentReserved reusing the id) meet the tombstone."""
    from branch_settlement.projections import model as ledger_model
    from tests.ledger import reference_model

    monkeypatch.setattr(ledger_model, "CLOSED_PARENT_RETENTION_MS", 300_000)
    monkeypatch.setattr(reference_model, "RETENTION_MS", 300_000)
    check_seed(seed, length=600)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=150, max_value=2**32))
def test_fold_matches_model_on_hypothesis_seeds(seed: int) -> None:
    check_seed(seed, length=200)


# -- the smallest sequences of disagreements the model found, now settled in SPEC's favour -------------------


def sequence(*steps: tuple) -> list[dict]:
    codec, events = default_codec(), []
    for n, (etype, parent_id, fields) in enumerate(steps, 1):
        key = fields.pop("key", None) or f"{parent_id}/{fields.get('child_id', etype)}/{n}"
        events.append(codec.event_from_json({"type": etype, "event_id": f"m{n}", "idempotency_key": key,
                                             "parent_id": parent_id, "occurred_at_ms": T0 + n, **fields}))
    return events


def parent(parent_id: str, ttl: int = 10**9) -> tuple:
    return ("ParentReserved", parent_id, dict(
        capacity={"tokens": {"quantity": 100, "kind": "logical"}, "gpus": {"quantity": 4, "kind": "physical"}},
        lease_ttl_ms=ttl, policy={"max_live_children": 4, "reconciliation_timeout_ms": 600_000,
                                  "lending_limit": {}}))


def tick(now: int) -> tuple:
    return ("Tick", "", dict(key=f"tick/0/{now}", now_ms=now))


MINIMAL = {
    # Two parents whose leases expire in the same tick each send their available balance to the pool: the
    # release keys must differ (they name the parent), or a consumer deduplicating on release_key (SPEC §10:
    # never return the same capacity twice, nor lose it) would drop one parent's capacity.
    "parents-expiring-in-one-tick": [tick(T0), parent("P0", ttl=1_000), parent("P1", ttl=1_000), tick(T0 + 2_000)],
    # A failure report that says the attempt ran (activated, usage uncertain) sends the child to
    # reconciliation and counts as its activation; a later "failed before activation" report of the same
    # attempt must not release it from `pending` (SPEC §4: reports are taken at their word where they prove
    # more than the state shows; §5: an uncertain outcome never means unused): invalid_transition.
    "never-started-after-reported-run": [
        tick(T0), parent("P"),
        ("ChildReserved", "P", dict(child_id="A", branch_id="A", attempt_id="A1", quantities={"tokens": 20})),
        ("ChildFailed", "P", dict(child_id="A", attempt_id="A1", lease_generation=0, activated=True,
                                  usage_uncertain=True, reason="worker lost")),
        ("ChildFailed", "P", dict(child_id="A", attempt_id="A1", lease_generation=0, activated=False,
                                  reason="never started")),
    ],
    # A usage report from an attempt in reconciliation (sent there by an uncertain acknowledgement before any
    # activation) proves it ran: a later "failed before activation" of it must not release it from `pending`.
    "never-started-after-a-usage-report-in-reconciliation": [
        tick(T0), parent("P"),
        ("ChildReserved", "P", dict(child_id="A", branch_id="A", attempt_id="A1", quantities={"tokens": 20})),
        ("CancelAcknowledged", "P", dict(child_id="A", attempt_id="A1", lease_generation=0, usage_uncertain=True)),
        ("UsageReported", "P", dict(child_id="A", attempt_id="A1", lease_generation=0, usage_report_id="r1",
                                    usage={}, final=False)),
        ("ChildFailed", "P", dict(child_id="A", attempt_id="A1", lease_generation=0, activated=False,
                                  reason="never started")),
    ],
}


@pytest.mark.parametrize("name", sorted(MINIMAL))
def test_minimal_sequence(name: str) -> None:
    check_events(sequence(*MINIMAL[name]), name)


def lending_parent(parent_id: str, ttl: int) -> tuple:
    step = parent(parent_id, ttl)
    step[2]["policy"]["lending_limit"] = {"tokens": 50}
    return step


def loan(parent_id: str, loan_id: str, tokens: int) -> tuple:
    return ("LoanRequested", parent_id, dict(key=f"{parent_id}/loan/{loan_id}/request", loan_id=loan_id,
                                             borrower="batch", quantities={"tokens": tokens}))


def test_a_tick_fires_its_timers_in_deadline_order_across_parents() -> None:
    """A tick that passes several deadlines fires them earliest first, whatever order the parents were reserved
    in: its outputs come in the order finer ticks would have given them (docs/contract.md, ledger time). Here
    P1 is reserved first but its lease ends last; both leases end before the second tick, and each expiring
    parent asks its open loan back."""
    events = sequence(tick(T0), lending_parent("P1", ttl=5_000), lending_parent("P2", ttl=1_000),
                      loan("P1", "L1", 10), loan("P2", "L2", 20), tick(T0 + 10_000))
    fold, batch = AuditedFold(open_view(MemoryStore(), default_codec()), auditor=LedgerAuditor()), Outputs()
    results = [fold.apply(event, offset, batch)["result"] for offset, event in enumerate(events)]
    assert results == ["ok"] * len(events)
    assert [(r["parent_id"], r["loan_id"]) for r in batch.revocations] == [("P2", "L2"), ("P1", "L1")]
    pool = [(r["parent_id"], r["dimension"]) for r in batch.releases if r["destination"] == "global_pool"]
    assert pool == [("P2", "gpus"), ("P2", "tokens"), ("P1", "gpus"), ("P1", "tokens")], pool
