"""The event being applied, with its position, and the outputs it produces.

The fold passes one `EventContext` through every step of applying an event, so an audit record or a
release always names its triggering event, input offset and ledger time without reading any global.
"""

from __future__ import annotations

from branch_settlement.processors.ledger.outputs import Outputs


class EventContext:
    __slots__ = ("event", "partition", "offset", "now_ms", "out", "touched", "touched_children", "overdrawn")

    def __init__(self, event: dict, partition: int, offset: int, now_ms: int, out: Outputs) -> None:
        self.event = event
        self.partition = partition
        self.offset = offset
        self.now_ms = now_ms
        self.out = out
        # Parents changed by this event: the invariant is checked on each once the event is applied.
        self.touched: dict[str, dict] = {}
        # Children already put to the view by this event (by id: the view holds these very records until the
        # checkpoint, so putting one again would change nothing).
        self.touched_children: dict[int, dict] = {}
        # Set when a settlement had to draw beyond the parent: the result is then `overdrawn`.
        self.overdrawn = False

    def audit(
        self,
        parent_id: str,
        child: dict | None,
        prior_state: str,
        new_state: str,
        note: str,
        dimension: str | None = None,
        quantity: int | None = None,
    ) -> None:
        event = self.event
        self.out.audits.append(
            {
                "parent_id": parent_id,
                "child_id": child["child_id"] if child else "",
                "attempt_id": child["attempt_id"] if child else "",
                "dimension": dimension,
                "quantity": quantity,
                "prior_state": prior_state,
                "new_state": new_state,
                "idempotency_key": event["idempotency_key"],
                "lease_generation": child["lease_generation"] if child else 0,
                "triggering_event_id": event["event_id"],
                "event_type": event["type"],
                "input_partition": self.partition,
                "input_offset": self.offset,
                "ledger_time_ms": self.now_ms,
                "note": note,
            }
        )

    def release(
        self, parent: dict, child: dict | None, dimension: str, quantity: int, destination: str, reason: str
    ) -> None:
        event = self.event
        child_id = child["child_id"] if child else ""
        parent_id = parent["parent_id"]
        self.out.releases.append(
            {
                "release_key": release_key(parent_id, event["idempotency_key"], child_id, dimension, destination),
                "parent_id": parent_id,
                "child_id": child_id,
                "attempt_id": child["attempt_id"] if child else "",
                "dimension": dimension,
                "quantity": quantity,
                "destination": destination,
                "reason": reason,
                "idempotency_key": event["idempotency_key"],
                "triggering_event_id": event["event_id"],
                "balance": dict(parent["dimensions"][dimension]),
                "input_partition": self.partition,
                "input_offset": self.offset,
                "ledger_time_ms": self.now_ms,
            }
        )

    def revocation(self, parent: dict, loan: dict, reason: str, child_id: str = "") -> None:
        """Ask the borrower of `loan` to return it (explicit borrowing): once per loan, the caller marks it."""
        event = self.event
        parent_id = parent["parent_id"]
        self.out.revocations.append(
            {
                "revocation_key": f"{parent_id}/loan/{loan['loan_id']}/revocation",
                "parent_id": parent_id,
                "loan_id": loan["loan_id"],
                "borrower": loan["borrower"],
                "quantities": dict(loan["quantities"]),
                "reason": reason,
                "idempotency_key": event["idempotency_key"],
                "triggering_event_id": event["event_id"],
                "triggering_event_type": event["type"],
                "child_id": child_id,
                "input_partition": self.partition,
                "input_offset": self.offset,
                "ledger_time_ms": self.now_ms,
            }
        )


def release_key(parent_id: str, idempotency_key: str, child_id: str, dimension: str, destination: str) -> str:
    """`<parent_id>/<idempotency_key>/<child_id or ->/<dimension>/<destination>`, unique per release: one event
    releases each child's dimension to one destination at most once; the parent id tells apart the parents one
    event (a tick) releases, and parents that happen to use the same idempotency key. The parts other than the
    idempotency key are percent-encoded ('%' and '/'), and a child named '-' is '%2D', since '-' stands for the
    parent: then the first '/' ends the parent id and the last three parts are read from the right, so no two
    releases' keys are the same string whatever their ids (a child named '-' once shared the key of its parent's
    own release). Ids of the usual kind are unchanged."""
    child = _key_part(child_id) if child_id else "-"
    return f"{_key_part(parent_id)}/{idempotency_key}/{child}/{_key_part(dimension)}/{destination}"


def _key_part(value: str) -> str:
    part = value.replace("%", "%25").replace("/", "%2F")
    return "%2D" if part == "-" else part
