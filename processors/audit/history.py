"""One parent's story, rebuilt by folding a partition's events: what `settle audit` shows.

A parent's ledger depends on the whole partition (ticks expire its leases, and ledger time is the
partition's), so every input is folded, through the same fold as the processor, into a fresh in-memory
projection. Of the outputs, only what names the chosen parent is kept, with a snapshot of its balances
after each step that could change them. Nothing here changes the fold or reads it from the inside: the
snapshot is `fold.view.parent(parent_id)` after each apply, copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from branch_settlement.processors.ledger import results
from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.replay.replayer import Input, open_view
from branch_settlement.projections import model
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas.codec import Codec, default_codec
from branch_settlement.processors.audit.errors import UnknownParentError

# The pseudo child id of the parent's own status row in the timelines.
PARENT_ROW = ""


@dataclass
class Step:
    """One input that touched the parent (an event naming it, or a tick while it was open), with what it
    did to the parent and the parent's balances afterwards (None before the parent was reserved)."""

    offset: int
    ledger_time_ms: int
    event_type: str
    event_id: str
    child_id: str
    attempt_id: str
    result: str
    detail: str
    audits: list[dict]
    releases: list[dict]
    settled: dict | None
    balances: dict[str, dict[str, int]] | None
    status: str | None
    loan_id: str = ""  # of a LoanRequested or LoanReturned
    revocations: list[dict] = field(default_factory=list)  # the loans of the parent this step asked back

    @property
    def is_tick(self) -> bool:
        return self.event_type == "Tick"

    @property
    def quiet(self) -> bool:
        """A tick that changed nothing of this parent."""
        return self.is_tick and not self.audits and not self.releases and self.settled is None and not self.revocations


@dataclass
class Segment:
    """A stretch of one child (or of the parent's status) in one state, attempt and lease generation.

    Several transitions can happen in one step (a tick expires a lease: activated -> expired ->
    reconciling), so a boundary is a step's offset plus the fraction of the step at which it happened
    (the j-th of n transitions of the row in that step starts at j / n). `end_offset` None: still there.
    """

    state: str
    attempt_id: str
    lease_generation: int
    start_offset: int
    start_fraction: float
    start_ms: int
    end_offset: int | None = None
    end_fraction: float = 0.0
    end_ms: int | None = None
    note: str = ""


@dataclass
class Timeline:
    """One child's states over ledger time (or, with child_id PARENT_ROW, the parent's status)."""

    child_id: str
    segments: list[Segment] = field(default_factory=list)

    @property
    def state(self) -> str:
        return self.segments[-1].state if self.segments else ""

    @property
    def attempts(self) -> list[str]:
        seen: list[str] = []
        for seg in self.segments:
            if seg.attempt_id and seg.attempt_id not in seen:
                seen.append(seg.attempt_id)
        return seen

    def states(self) -> list[str]:
        """The states passed through, in order, without repeats of the same state."""
        path: list[str] = []
        for seg in self.segments:
            if not path or path[-1] != seg.state:
                path.append(seg.state)
        return path


@dataclass
class History:
    parent_id: str
    partition: int
    steps: list[Step]
    parent: dict  # the parent's ledger record at the end, copied
    children: dict[str, dict]  # child_id -> the child's ledger record at the end, copied
    timelines: dict[str, Timeline]  # PARENT_ROW first, then children in order of reservation
    inputs: int = 0  # inputs read from the partition (events and dead letters)
    dead_letters: int = 0  # inputs that were not events: no parent can be told, so only counted

    @property
    def status(self) -> str:
        return self.parent["status"]

    @property
    def outcome(self) -> str | None:
        return self.parent["outcome"]

    @property
    def dimensions(self) -> dict[str, dict]:
        """Final balances per dimension, as the ledger holds them (with `kind`)."""
        return self.parent["dimensions"]

    @property
    def points(self) -> list[Step]:
        """The steps with a balance snapshot: what the chart draws."""
        return [step for step in self.steps if step.balances is not None]

    @property
    def releases(self) -> list[dict]:
        return [rel for step in self.steps for rel in step.releases]

    @property
    def audits(self) -> list[dict]:
        return [audit for step in self.steps for audit in step.audits]

    @property
    def settled(self) -> dict | None:
        return next((step.settled for step in self.steps if step.settled is not None), None)

    @property
    def loans(self) -> list[dict]:
        """The parent's loans at the end (explicit borrowing), oldest first, as the ledger holds them."""
        return self.parent.get("loans", [])

    @property
    def revocations(self) -> list[dict]:
        return [rec for step in self.steps for rec in step.revocations]

    def loan_steps(self, loan_id: str) -> dict[str, Step]:
        """The applied steps of a loan: "lent" (its LoanRequested), "asked" (the step that asked it back),
        "returned" (its LoanReturned); absent ones are missing."""
        found: dict[str, Step] = {}
        for step in self.steps:
            if step.loan_id == loan_id and step.result in results.APPLIED:
                found["lent" if step.event_type == "LoanRequested" else "returned"] = step
            if any(rec["loan_id"] == loan_id for rec in step.revocations):
                found["asked"] = step
        return found


def parent_history(inputs: Iterable[Input], parent_id: str, codec: Codec | None = None,
                   partition: int = 0, partitions: int | None = None) -> History:
    """Fold every input into a fresh MemoryStore and collect the history of `parent_id`; `partitions`: the
    topic's partition count when the inputs are a topic partition's (processors/ledger/fold.py, Fold).

    Raises UnknownParentError when no input reserved the parent; InvariantViolation from the fold
    propagates (it is a bug, and the audit must not paper over it).
    """
    codec = codec or default_codec()
    view = open_view(MemoryStore(), codec)
    fold = Fold(view, partition, partitions)
    out = Outputs()
    steps: list[Step] = []
    inputs_read = dead_letters = named = 0
    for item in inputs:
        inputs_read += 1
        if item.event is None:
            dead_letters += 1
            continue
        before = view.parent(parent_id)
        live_before = before is not None and before["status"] != model.PARENT_CLOSED
        out.clear()
        result = fold.apply(item.event, item.offset, out, item.ledger_tick)
        names_parent = item.event["parent_id"] == parent_id
        named += names_parent
        step = _step(item.event, result, out, parent_id)
        if names_parent or step.audits or step.releases or step.settled is not None or step.revocations or (
                step.is_tick and result["result"] == results.OK and live_before):
            after = view.parent(parent_id)
            if after is not None:
                step.balances = _balances(after)
                step.status = after["status"]
            steps.append(step)
    parent = view.parent(parent_id)
    if parent is None:
        raise UnknownParentError(_unknown_message(parent_id, named, inputs_read, steps))
    children = {}
    for child_id in parent["children"]:
        child = view.child(parent_id, child_id)
        children[child_id] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in child.items()}
    return History(
        parent_id=parent_id,
        partition=partition,
        steps=steps,
        parent=_copy_parent(parent),
        children=children,
        timelines=build_timelines(steps, list(parent["children"])),
        inputs=inputs_read,
        dead_letters=dead_letters,
    )


def _step(event: dict, result: dict, out: Outputs, parent_id: str) -> Step:
    settled = [rec for rec in out.settled if rec["parent_id"] == parent_id]
    return Step(
        offset=result["input_offset"],
        ledger_time_ms=result["ledger_time_ms"],
        event_type=event["type"],
        event_id=event["event_id"],
        child_id=event.get("child_id") or "",
        # A loan's events name no child: the tables show the loan in the attempt's place.
        attempt_id=event.get("attempt_id") or event.get("winner_attempt_id") or event.get("to_attempt_id")
        or (f"loan {event['loan_id']}" if event.get("loan_id") else ""),
        result=result["result"],
        detail=result["detail"],
        audits=[dict(a) for a in out.audits if a["parent_id"] == parent_id],
        releases=[dict(rel) for rel in out.releases if rel["parent_id"] == parent_id],
        settled=dict(settled[0]) if settled else None,
        balances=None,
        status=None,
        loan_id=event.get("loan_id") or "",
        revocations=[dict(rec) for rec in out.revocations if rec["parent_id"] == parent_id],
    )


def _balances(parent: dict) -> dict[str, dict[str, int]]:
    return {dim: {term: balance[term] for term in model.BALANCE_TERMS}
            for dim, balance in sorted(parent["dimensions"].items())}


def _copy_parent(parent: dict) -> dict:
    copied = dict(parent)
    copied["dimensions"] = {dim: dict(balance) for dim, balance in sorted(parent["dimensions"].items())}
    copied["children"] = list(parent["children"])
    copied["loans"] = [dict(loan, quantities=dict(loan["quantities"]), usage=dict(loan["usage"]))
                       for loan in parent.get("loans", [])]
    return copied


def _unknown_message(parent_id: str, named: int, inputs_read: int, steps: list[Step]) -> str:
    if not named:
        return f"no event names parent {parent_id!r} ({inputs_read} inputs read)"
    codes = sorted({step.result for step in steps if step.event_type != "Tick"})
    return (f"parent {parent_id!r} was never reserved: {named} events name it, "
            f"with results {', '.join(codes)}")


def build_timelines(steps: list[Step], child_order: list[str]) -> dict[str, Timeline]:
    """State segments per child (and the parent's status) from the audit records of the steps.

    A segment starts at a change of state, attempt or lease generation; audit records that change none
    of them (usage committed, escalations, renewals of the same generation) do not split a segment.
    """
    rows: dict[str, Timeline] = {PARENT_ROW: Timeline(PARENT_ROW)}
    rows.update((child_id, Timeline(child_id)) for child_id in child_order)
    for step in steps:
        started: dict[str, list[Segment]] = {}
        for audit in step.audits:
            if model.is_loan_audit(audit):  # a loan's records name no child: they are not the parent's status
                continue
            row = rows.setdefault(audit["child_id"], Timeline(audit["child_id"]))
            key = (audit["new_state"], audit["attempt_id"], audit["lease_generation"])
            last = row.segments[-1] if row.segments else None
            if last is not None and (last.state, last.attempt_id, last.lease_generation) == key:
                continue
            seg = Segment(*key, step.offset, 0.0, step.ledger_time_ms, note=audit["note"])
            row.segments.append(seg)
            started.setdefault(audit["child_id"], []).append(seg)
        for child_id, new in started.items():
            segments = rows[child_id].segments
            for j, seg in enumerate(new):
                seg.start_fraction = j / len(new)
            start = max(len(segments) - len(new) - 1, 0)
            for before, after in zip(segments[start:], segments[start + 1:]):
                before.end_offset, before.end_fraction, before.end_ms = (
                    after.start_offset, after.start_fraction, after.start_ms)
    return {child_id: row for child_id, row in rows.items() if row.segments}
