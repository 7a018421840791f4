"""Errors of the fold: bugs, never bad input (bad input is a result code or a dead letter)."""

from __future__ import annotations

from branch_settlement.errors import SettlementError


class InvariantViolation(SettlementError):
    """The accounting invariant of SPEC §3 broke after an event: a bug in the fold, never bad input.

    Raised by the fold after it applied an event. The processor stops the partition (other partitions go
    on), leaves its last committed state untouched and reports loudly. Operator: keep the partition
    stopped, keep the input, file the event offset and the message; never "repair" with a release.
    """

    def __init__(self, parent_id: str, dimension: str, detail: str, event_id: str, offset: int | None = None,
                 diagnosis: str = "") -> None:
        self.parent_id = parent_id
        self.dimension = dimension
        self.event_id = event_id
        self.offset = offset
        at = f" at input offset {offset}" if offset is not None else ""
        super().__init__(f"invariant violated for parent {parent_id!r} dimension {dimension!r} "
                         f"after event {event_id!r}{at}: {detail}" + (f"; {diagnosis}" if diagnosis else ""))


class LedgerAuditFailure(InvariantViolation):
    """The ledger auditor (processors/ledger/auditor.py) recomputed a balance term, a child's conservation of
    what it held, or a parent's closing condition from first principles and found the fold's ledger
    disagreeing, even where the invariant's sum still holds: a bug in the fold, never bad input.

    Raised where the auditor runs: the tests, the bounded exhaustive check and the fault simulation.
    Operator or developer: keep the input, reproduce with the seed or sequence the message names, fix the
    fold."""
