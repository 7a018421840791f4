"""Bounded exhaustive check of the fold: every event sequence up to a depth over a small universe, breadth
first, equal ledger states explored once.

The universe: one parent (10 `tokens`, logical; 2 `gpus`, physical; at most 2 live children; a 30 ms lease),
two children (`c1` reserves 4 tokens and 1 GPU, `c2` 4 tokens; both on branch `b`, so they race as speculative
copies), two attempts each (`a1` and the retry `a2`), two lease generations, and ticks that cross each child's
10 ms lease, its 10 ms reconciliation timeout and the parent's lease. The alphabet (`alphabet()`) holds every
event type of the contract with the variants that the rules tell apart: attempts that hold the child and ones
that do not, generations granted, stale and unknown, known and uncertain usage, hand-offs to the retry,
overruns, physical releases confirmed with the right and the wrong dimension, redeliveries (each event has one
idempotency key, so applying it twice is a duplicate) and an idempotency conflict for each kind of key.

After every step it checks: the fold raised nothing (an invariant violation is a bug like any other), the
ledger auditor (processors/ledger/auditor.py: every balance term recomputed, each child's conservation, every
release key once), and determinism: the same event applied again to the same state gives the same outputs and
the same ledger, byte for byte. A start state has the parent reserved at the partition's first tick, and
perhaps a few events more (`STARTS`): from 'running', depth 4 already holds an expiry, a hand-off to the
retry, its activation and its settlement.

Borrowing has a universe of its own (`lending_alphabet()`, start 'lending'): a parent of 10 tokens (logical) and
2 GPUs (physical) lending at most 6 tokens and 1 GPU, three loans (one beyond the limit together with the
others), returns within and beyond the loan and a second return of the same loan under its key with another
usage, a return of a loan never lent, siblings whose reservations only a revocation can satisfy, a completion, a
skip, the close and the parent's lease expiry. The main universe sends a loan and its return too, to a parent
that lends nothing. Beyond the auditor's checks (lent recomputed from the open loans and within the limit, a
loan asked back once and returned once, a closing parent that closes with no loan open), each
`awaiting_revocation` is checked to have asked exactly the newest loans needed (`check_revocation`).

`python -m tests.ledger.exhaustive --depth N` (`make verify DEPTH=N`) prints, per start, the depth and the number
of distinct states explored; a failure prints the sequence that reaches it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from branch_settlement.processors.ledger.auditor import AuditedFold, LedgerAuditor
from branch_settlement.processors.ledger.outputs import OUTPUT_ROUTES, Outputs
from branch_settlement.projections import model as ledger_model
from branch_settlement.projections.store import MemoryStore
from branch_settlement.projections.view import CacheBudget, LedgerView
from branch_settlement.schemas.codec import default_codec

PARENT = "P"
START_MS = 1_000
CHILD_TTL_MS = 10
RECONCILIATION_MS = 10
PARENT_TTL_MS = 30
# Ticks after the start: past a lease granted at the start, past its reconciliation timeout (and a lease
# granted after the first tick), past the parent's lease.
TICKS_MS = (START_MS + 11, START_MS + 22, START_MS + 33)
# The closed parent's retention (decision 22) within these ticks, so that sequences reach the compacted
# tombstone and every event after it (explore sets projections/model.py's constant to it while it runs).
RETENTION_MS = 10
CHILDREN = {"c1": {"tokens": 4, "gpus": 1}, "c2": {"tokens": 4}}
BRANCH = "b"
CODEC = default_codec()
# Views made here must not share (and reshare) the process-wide cache budget: one of its own, never trimmed.
_BUDGET = CacheBudget(1 << 40)


def parent_reserved(tokens: int = 10, lending_limit: dict | None = None) -> dict:
    return {"type": "ParentReserved", "capacity": {"tokens": {"quantity": tokens, "kind": "logical"},
                                                   "gpus": {"quantity": 2, "kind": "physical"}},
            "lease_ttl_ms": PARENT_TTL_MS,
            "policy": {"max_live_children": 2, "reconciliation_timeout_ms": RECONCILIATION_MS,
                       "lending_limit": lending_limit or {}}}


LENDING_LIMIT = {"tokens": 6, "gpus": 1}


def loan_key(loan_id: str, verb: str) -> str:
    return f"{PARENT}/loan/{loan_id}/{verb}"


def _events(events: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    return {label: CODEC.event_from_json({"event_id": label, "idempotency_key": key, "parent_id": PARENT,
                                          "occurred_at_ms": 0, **fields})
            for label, (key, fields) in events.items()}


def lending_alphabet() -> dict[str, dict]:
    """The borrowing universe's events (label -> event), as `alphabet`: a loan's events carry its own keys, so
    two labels for one loan's return are one key with two payloads."""
    events: dict[str, tuple[str, dict]] = {}

    def add(label: str, etype: str, key: str | None = None, **fields) -> None:
        events[label] = (key or label, {"type": etype, **fields})

    for loan_id, quantities in (("L1", {"tokens": 3}), ("L2", {"tokens": 2, "gpus": 1}), ("L3", {"tokens": 3})):
        add(f"lend {loan_id}", "LoanRequested", key=loan_key(loan_id, "request"), loan_id=loan_id,
            borrower=f"w-{loan_id}", quantities=quantities)
    add("lend L1!", "LoanRequested", key=loan_key("L1", "request"), loan_id="L1", borrower="w-other",
        quantities={"tokens": 1})
    add("lend L4 gpus", "LoanRequested", key=loan_key("L4", "request"), loan_id="L4", borrower="w-L4",
        quantities={"gpus": 1})
    for loan_id, usage in (("L1", {}), ("L1", {"tokens": 5}), ("L2", {"tokens": 1, "gpus": 1}), ("L3", {"tokens": 1}),
                           ("L9", {})):
        label = f"return {loan_id} " + (",".join(f"{d}{q}" for d, q in usage.items()) or "0")
        add(label, "LoanReturned", key=loan_key(loan_id, "return"), loan_id=loan_id, usage=usage)
    add("reserve c1", "ChildReserved", child_id="c1", branch_id="b1", attempt_id="a1", quantities={"tokens": 4})
    add("reserve c2", "ChildReserved", child_id="c2", branch_id="b2", attempt_id="a1",
        quantities={"tokens": 6, "gpus": 2})
    add("activate c1", "ChildActivated", child_id="c1", attempt_id="a1", lease_generation=1, lease_ttl_ms=100)
    add("complete c1", "ChildCompleted", child_id="c1", attempt_id="a1", lease_generation=1, usage={"tokens": 2})
    add("skip c2", "ChildSkipped", child_id="c2", attempt_id="a1", reason="not needed")
    add("confirm c2 gpus", "SchedulerReleaseConfirmed", child_id="c2", attempt_id="a1", dimension="gpus")
    add("close", "ParentClosed", outcome="succeeded")
    out = _events(events)
    out["tick 33"] = tick(START_MS + 33)  # past the parent's lease
    return out


def alphabet() -> dict[str, dict]:
    """label -> event (JSON form, without the common fields). Each label is its own idempotency key, so a
    label applied twice is a redelivery; labels ending in `!` reuse another label's key with another payload."""
    events: dict[str, tuple[str, dict]] = {}

    def add(label: str, etype: str, key: str | None = None, **fields) -> None:
        events[label] = (key or label, {"type": etype, **fields})

    add("reserve-parent!", "ParentReserved", key="reserve-parent", **{k: v for k, v in parent_reserved(9).items()
                                                                        if k != "type"})
    for child, quantities in CHILDREN.items():
        gpus = "gpus" in quantities
        add(f"reserve {child}", "ChildReserved", child_id=child, branch_id=BRANCH, attempt_id="a1",
            quantities=quantities)
        add(f"reserve {child}!", "ChildReserved", key=f"reserve {child}", child_id=child, branch_id=BRANCH,
            attempt_id="a1", quantities={"tokens": 1})
        for attempt, generation in (("a1", 1), ("a2", 2), ("a1", 2)):
            add(f"activate {child} {attempt} g{generation}", "ChildActivated", child_id=child, attempt_id=attempt,
                lease_generation=generation, lease_ttl_ms=CHILD_TTL_MS)
        add(f"renew {child} a1 g1", "LeaseRenewed", child_id=child, attempt_id="a1", lease_generation=1,
            lease_ttl_ms=CHILD_TTL_MS)
        add(f"renew {child} a1 g2", "LeaseRenewed", child_id=child, attempt_id="a1", lease_generation=2,
            lease_ttl_ms=CHILD_TTL_MS)
        for attempt, generation in (("a1", 1), ("a2", 2), ("a1", 2)):
            usage = {"tokens": 2, "gpus": 1} if gpus else {"tokens": 2}
            add(f"usage {child} {attempt} g{generation}", "UsageReported", child_id=child, attempt_id=attempt,
                lease_generation=generation, usage_report_id=f"r-{attempt}", usage=usage, final=False)
        add(f"usage! {child} a1 g1", "UsageReported", key=f"usage {child} a1 g1", child_id=child, attempt_id="a1",
            lease_generation=1, usage_report_id="r-a1", usage={"tokens": 3}, final=False)
        add(f"final {child} a1 g1", "UsageReported", child_id=child, attempt_id="a1", lease_generation=1,
            usage_report_id="r-final", usage={"tokens": 1}, final=True)
        for attempt, generation, tokens in (("a1", 1, 3), ("a2", 2, 1), ("a1", 1, 6)):
            usage = {"tokens": tokens, "gpus": 1} if gpus else {"tokens": tokens}
            add(f"complete {child} {attempt} g{generation} {tokens}", "ChildCompleted", child_id=child,
                attempt_id=attempt, lease_generation=generation, usage=usage)
        add(f"skip {child} a1", "ChildSkipped", child_id=child, attempt_id="a1", reason="not needed")
        add(f"cancel {child} a1", "CancelRequested", child_id=child, attempt_id="a1", reason="user")
        add(f"ack {child} a1 g1 1", "CancelAcknowledged", child_id=child, attempt_id="a1", lease_generation=1,
            usage={"tokens": 1})
        add(f"ack {child} a1 g1 ?", "CancelAcknowledged", child_id=child, attempt_id="a1", lease_generation=1,
            usage_uncertain=True)
        add(f"ack {child} a1 g1 1 retry", "CancelAcknowledged", child_id=child, attempt_id="a1",
            lease_generation=1, usage={"tokens": 1}, retry_attempt_id="a2")
        add(f"fail {child} a1 g1 1", "ChildFailed", child_id=child, attempt_id="a1", lease_generation=1,
            activated=True, usage={"tokens": 1}, reason="boom")
        add(f"fail {child} a1 g1 ?", "ChildFailed", child_id=child, attempt_id="a1", lease_generation=1,
            activated=True, usage_uncertain=True, reason="lost")
        add(f"fail {child} a1 g1 1 retry", "ChildFailed", child_id=child, attempt_id="a1", lease_generation=1,
            activated=True, usage={"tokens": 1, "gpus": 1} if gpus else {"tokens": 1}, reason="boom",
            retry_attempt_id="a2")
        add(f"fail {child} a1 unstarted", "ChildFailed", child_id=child, attempt_id="a1", lease_generation=0,
            activated=False, reason="never started")
        add(f"fail {child} a2 g2 ?", "ChildFailed", child_id=child, attempt_id="a2", lease_generation=2,
            activated=True, usage_uncertain=True, reason="lost")
        add(f"transfer {child} a1>a2", "ReservationTransferred", child_id=child, from_attempt_id="a1",
            to_attempt_id="a2")
        for attempt in ("a1", "a2"):
            add(f"resolve {child} {attempt}", "ReconciliationResolved", child_id=child, attempt_id=attempt,
                usage={"tokens": 2}, resolution="late_report")
        add(f"adjust {child} a1", "UsageAdjustment", child_id=child, attempt_id="a1", usage={"tokens": 1},
            reason="invoice")
        for attempt in ("a1", "a2"):
            add(f"confirm {child} {attempt} gpus", "SchedulerReleaseConfirmed", child_id=child, attempt_id=attempt,
                dimension="gpus")
        add(f"confirm {child} a1 tokens", "SchedulerReleaseConfirmed", child_id=child, attempt_id="a1",
            dimension="tokens")
    add("winner a1", "SpeculativeWinner", branch_id=BRANCH, winner_attempt_id="a1")
    add("winner a2", "SpeculativeWinner", branch_id=BRANCH, winner_attempt_id="a2")
    add("close", "ParentClosed", outcome="succeeded")
    add("close!", "ParentClosed", key="close", outcome="failed")
    # This parent lends nothing: a loan is `lending_not_allowed`, its return `unknown_loan`.
    add("lend L1", "LoanRequested", key=loan_key("L1", "request"), loan_id="L1", borrower="w", quantities={"tokens": 1})
    add("return L1", "LoanReturned", key=loan_key("L1", "return"), loan_id="L1", usage={})
    out = _events(events)
    for now_ms in TICKS_MS:
        out[f"tick {now_ms - START_MS}"] = tick(now_ms)
    return out


def tick(now_ms: int) -> dict:
    return CODEC.event_from_json({"type": "Tick", "event_id": f"tick-{now_ms}", "idempotency_key": f"tick/{now_ms}",
                                  "parent_id": "", "occurred_at_ms": 0, "now_ms": now_ms})


State = tuple[tuple[bytes, bytes], ...]  # the store's contents, sorted: equal ledgers, equal states


@dataclass
class Node:
    state: State
    auditor: object  # the auditor's snapshot after reaching the state
    path: tuple[str, ...]


class CheckFailure(AssertionError):
    """A sequence broke a rule; the message names it."""


def audited_fold(state: State, auditor_snapshot: object | None,
                 implementation: str | None = None) -> tuple[MemoryStore, AuditedFold]:
    """A fold, with its auditor where it was (`auditor_snapshot`), over a fresh store holding `state`; of the
    implementation schemas/native.py selects unless `implementation` says."""
    store = MemoryStore()
    store.write(state, 0)
    auditor = LedgerAuditor()
    if auditor_snapshot is not None:
        auditor.restore(auditor_snapshot)
    view = LedgerView(store, CODEC.encode, CODEC.decode, _BUDGET)
    return store, AuditedFold(view, auditor=auditor, implementation=implementation)


def ledger_state(store: MemoryStore) -> State:
    return tuple(sorted(store._data.items()))


def step(node: Node, label: str, event: dict, implementation: str | None = None) -> tuple[State, object, bytes]:
    """Apply `event` to the node's ledger: (the new state, the auditor's snapshot, the outputs' bytes)."""
    store, fold = audited_fold(node.state, node.auditor, implementation)
    out = Outputs()
    prior = fold.view.parent(PARENT) if event["type"] == "ChildReserved" else None
    prior = CODEC.decode(CODEC.encode("LedgerParent", prior))[1] if prior is not None and prior["loans"] else None
    result = fold.apply(event, len(node.path), out)
    if result["result"] == "awaiting_revocation" and prior is not None:
        check_revocation(prior, event["quantities"], [r["loan_id"] for r in out.revocations])
    store.write(fold.view.changes(), 0)
    encoded = b"".join(CODEC.encode(name, record) for attr, _, name in OUTPUT_ROUTES for record in getattr(out, attr))
    return ledger_state(store), fold.auditor.snapshot(), encoded


def check_revocation(prior: dict, quantities: dict, asked: list[str]) -> None:
    """A reservation was `awaiting_revocation`: what is lent covered its shortfall, and the loans asked back now
    are exactly the newest needed. Walking the open loans from the newest: one not asked before is asked iff it
    holds some of a dimension that the loans asked so far (before, and newer ones now) do not yet cover."""
    dims = prior["dimensions"]
    short = {dim: q - dims[dim]["available"] for dim, q in quantities.items() if q > dims[dim]["available"]}
    if not short or any(q > dims[dim]["available"] + dims[dim]["lent"] for dim, q in quantities.items()):
        raise CheckFailure(f"awaiting_revocation for {quantities}, but the balances {dims} do not call for it")
    loans = [loan for loan in prior["loans"] if loan["state"] == "open"]
    cover = {dim: sum(loan["quantities"].get(dim, 0) for loan in loans if loan["revocation_requested"]) for dim in short}
    want = []
    for loan in reversed(loans):
        if loan["revocation_requested"]:
            continue
        if any(cover[dim] < need and loan["quantities"].get(dim, 0) > 0 for dim, need in short.items()):
            want.append(loan["loan_id"])
            for dim in short:
                cover[dim] += loan["quantities"].get(dim, 0)
    if asked != want:
        raise CheckFailure(f"reservation of {quantities} short by {short}: asked back {asked}, the newest loans "
                           f"needed are {want}")


# Where the exploration starts, after the partition's first tick and the parent's reservation: the universe
# and the prefix of its alphabet's labels applied first (each must be `ok`). A later start reaches deeper
# sequences at the same depth.
STARTS = {
    "parent": ("main", ()),
    "running": ("main", ("reserve c1", "activate c1 a1 g1", "reserve c2")),
    "lending": ("lending", ("lend L1",)),
}
UNIVERSES = {"main": (alphabet, {}), "lending": (lending_alphabet, LENDING_LIMIT)}


def start(name: str = "parent") -> Node:
    universe, prefix = STARTS[name]
    make_alphabet, lending_limit = UNIVERSES[universe]
    store, fold = audited_fold((), None)
    out = Outputs()
    fold.apply(tick(START_MS), 0, out)
    parent = CODEC.event_from_json({"event_id": "reserve-parent", "idempotency_key": "reserve-parent",
                                    "parent_id": PARENT, "occurred_at_ms": 0,
                                    **parent_reserved(lending_limit=lending_limit)})
    assert fold.apply(parent, 1, out)["result"] == "ok"
    events = make_alphabet()
    for offset, label in enumerate(prefix, start=2):
        assert fold.apply(events[label], offset, out)["result"] == "ok", label
    store.write(fold.view.changes(), 0)
    return Node(ledger_state(store), fold.auditor.snapshot(), ("tick 0", "reserve-parent", *prefix))


def explore(depth: int, deterministic_every: int = 1, report=None, start_name: str = "parent",
            against: str | None = None) -> dict:
    """Breadth first to `depth` events after the start. Returns the counts; raises CheckFailure.
    `deterministic_every`: apply every n-th step twice to compare bytes (1: every step). `against`: also apply
    every step with that implementation of the fold (schemas/native.py), which must give the same ledger, the same
    outputs and the same auditor's view, byte for byte."""
    retention = ledger_model.CLOSED_PARENT_RETENTION_MS
    ledger_model.CLOSED_PARENT_RETENTION_MS = RETENTION_MS
    try:
        return _explore(depth, deterministic_every, report, start_name, against)
    finally:
        ledger_model.CLOSED_PARENT_RETENTION_MS = retention


def _explore(depth: int, deterministic_every: int, report, start_name: str, against: str | None) -> dict:
    events = UNIVERSES[STARTS[start_name][0]][0]()
    root = start(start_name)
    seen = {root.state}
    frontier = [root]
    steps = 0
    started = time.monotonic()
    per_depth = []
    for level in range(1, depth + 1):
        next_frontier = []
        for node in frontier:
            for label, event in events.items():
                steps += 1
                try:
                    state, auditor, encoded = step(node, label, event)
                    if steps % deterministic_every == 0:
                        again = step(node, label, event)
                        if again[0] != state or again[2] != encoded:
                            raise CheckFailure("the same event on the same ledger gave other bytes")
                    if against is not None:
                        other = step(node, label, event, against)
                        if other[0] != state or other[2] != encoded or other[1] != auditor:
                            raise CheckFailure(f"the {against} fold gave other bytes")
                except Exception as failure:
                    path = " -> ".join(node.path + (label,))
                    raise CheckFailure(f"depth {level}: {type(failure).__name__}: {failure}\n"
                                       f"sequence: {path}") from failure
                if state not in seen:
                    seen.add(state)
                    next_frontier.append(Node(state, auditor, node.path + (label,)))
        frontier = next_frontier
        per_depth.append(len(frontier))
        if report:
            report(f"depth {level}: {len(frontier)} new states, {len(seen)} distinct in all, {steps} steps, "
                   f"{time.monotonic() - started:.1f} s")
        if not frontier:
            break
    return {"start": start_name, "depth": depth, "alphabet": len(events), "distinct_states": len(seen), "steps": steps,
            "new_per_depth": per_depth, "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.ledger.exhaustive", description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=4, help="events after the start state (default 4)")
    parser.add_argument("--determinism-every", type=int, default=1, metavar="N",
                        help="apply every N-th step twice and compare the bytes (default 1: every step)")
    parser.add_argument("--start", choices=sorted(STARTS), action="append",
                        help="the start state(s): 'parent' (just reserved), 'running' (c1 reserved and "
                             "activated, c2 reserved), 'lending' (a parent that lends, loan L1 out); default all")
    args = parser.parse_args(argv)
    for name in args.start or sorted(STARTS):
        print(f"start {name!r}: {' -> '.join(STARTS[name][1]) or 'the parent reserved'}", flush=True)
        try:
            counts = explore(args.depth, args.determinism_every, report=lambda line: print(line, flush=True),
                             start_name=name)
        except CheckFailure as failure:
            print(f"FAILED: {failure}", file=sys.stderr)
            return 1
        print(f"checked from {name!r}: depth {counts['depth']}, alphabet {counts['alphabet']} events, "
              f"{counts['distinct_states']} distinct states, {counts['steps']} steps, {counts['seconds']} s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
