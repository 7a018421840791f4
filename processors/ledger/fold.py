"""The fold: `Fold.apply(event, offset, out)` applies one event to the ledger and appends its outputs.

Pure in the sense that matters: no I/O of its own (it reads and writes a LedgerView, which buffers), no
clock (ledger time comes from Tick events), no randomness, and iteration orders are fixed, so the same
events in the same order give the same ledger and the same outputs, byte for byte.

Per event, in order:
1. semantic validation (validation.py: ids, quantities, times within their limits, enumerations) ->
   `invalid_event`, nothing changes;
2. idempotency: a stored result under the same key -> `duplicate` (same payload) or
   `idempotency_conflict` (another payload), nothing changes;
3. the handler decides (a rejection code, nothing changes) or applies;
4. the accounting invariant is checked on every parent the event changed; a violation raises
   InvariantViolation, which stops the partition;
5. exactly one result is emitted; an applied event's result is stored under its idempotency key.
"""

from __future__ import annotations

import hashlib
import json
import operator
from functools import cache

from branch_settlement.processors.ledger import results
from branch_settlement.processors.ledger.context import EventContext
from branch_settlement.processors.ledger.errors import InvariantViolation
from branch_settlement.processors.ledger import handlers, validation
from branch_settlement.processors.ledger.handlers import HANDLERS, Reject, fire_timer, rebase_timers
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.ledger.validation import validate
from branch_settlement.projections import keys, model
from branch_settlement.projections import view as ledger_view
from branch_settlement.projections.view import LedgerView
from branch_settlement.schemas.codec import EVENT_TYPES, SCHEMA_DIR, Codec
from branch_settlement.schemas.registry import load_registry
from branch_settlement.schemas.partitioning import partition_of
from branch_settlement.schemas import limits, native
from branch_settlement.schemas.event_json import compile_sorted_json, sorted_json_plan

# Fields that describe a delivery, not the settlement: left out of the payload comparison (SPEC §10).
DELIVERY_FIELDS = ("event_id", "occurred_at_ms")

# The payload's canonical form: JSON with keys sorted at every level, so equal payloads give equal bytes
# whatever their key order. Stored digests were made with exactly these options: changing them would turn
# every redelivery of an event applied before the change into an `idempotency_conflict`. Made once, because
# json.dumps with options builds a new encoder per call; no cycle check, since a decoded event is a tree.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, check_circular=False)


def _canonical_json(event: dict) -> str:
    payload = dict(event)
    for field in DELIVERY_FIELDS:
        payload.pop(field, None)
    return _CANONICAL_JSON.encode(payload)


def _sorted_json_writers() -> dict:
    """Per event type, the same text as `_canonical_json` written by a function generated from the event's
    schema (schemas/event_json.py), or None where it is not sure (then `_canonical_json` writes it)."""
    return {name: compile_sorted_json(name, _EVENT_SCHEMAS[name].parsed, DELIVERY_FIELDS) for name in EVENT_TYPES}


# The current schemas, read once at import: no codec yet (its implementation is chosen later, schemas/native.py).
_EVENT_SCHEMAS = load_registry(SCHEMA_DIR).current
_SORTED_JSON = _sorted_json_writers()
_blake2b = hashlib.blake2b


def _python_digest(sorted_json):
    def digest(event: dict) -> bytes | None:
        data = sorted_json(event)
        return None if data is None else _blake2b(data, digest_size=16).digest()
    return digest


def _digest_writers() -> dict:
    """Per event type, the digest of `_SORTED_JSON`'s text, or None where it is not sure: the compiled module's
    (native/, SortedJsonDigest, from the same plan) or the generated Python's, as schemas/native.py selects. Made at
    the first digest, not at import, so that `settle --implementation` has set the choice by then."""
    global _DIGESTS
    if native.select() == native.COMPILED:
        plans = {name: sorted_json_plan(_EVENT_SCHEMAS[name].parsed, DELIVERY_FIELDS) for name in EVENT_TYPES}
        _DIGESTS = {name: native.module().SortedJsonDigest(plan) if plan is not None else (lambda event: None)
                    for name, plan in plans.items()}
    else:
        _DIGESTS = {name: _python_digest(writer) for name, writer in _SORTED_JSON.items()}
    return _DIGESTS


_DIGESTS: dict | None = None


def _digests() -> dict:
    return _DIGESTS or _digest_writers()  # a bad SETTLE_IMPLEMENTATION: its ConfigError, not a slow path


def payload_digest(event: dict) -> bytes:
    writers = _digests()
    try:
        digest = writers[event["type"]](event)
    except Exception:  # not an event of a known type: json.dumps below says what it is
        digest = None
    if digest is None:
        digest = _blake2b(_canonical_json(event).encode(), digest_size=16).digest()
    return digest


# The invariant runs after every applied event on every parent it touched: each balance's terms are fetched in
# one C-level call, and checked with min and sum (the held terms add up to capacity + overdrawn exactly when all
# nine add up to twice that); a term is looked at by name only to describe a violation.
_balance_terms = operator.itemgetter(*model.BALANCE_TERMS)
_held_terms = operator.itemgetter(*model.HELD_TERMS)
_CAPACITY = model.BALANCE_TERMS.index("capacity")
_OVERDRAWN = model.BALANCE_TERMS.index("overdrawn")


def check_invariant(parent: dict, ctx: EventContext, view: LedgerView) -> None:
    live = parent["live_children"]
    if 0 <= live <= parent["open_children"]:
        for balance in parent["dimensions"].values():
            terms = _balance_terms(balance)
            if min(terms) < 0 or sum(terms) != 2 * (terms[_CAPACITY] + terms[_OVERDRAWN]):
                break
        else:
            return
    _raise_violation(parent, ctx, view)


def _raise_violation(parent: dict, ctx: EventContext, view: LedgerView) -> None:
    """The first violation of the parent, described with what its children say the terms should be."""
    parent_id = parent["parent_id"]
    event_id, offset = ctx.event["event_id"], ctx.offset
    diagnosis = describe_children(parent, ctx, view)
    if not 0 <= parent["live_children"] <= parent["open_children"]:
        raise InvariantViolation(parent_id, "*", f"live_children = {parent['live_children']}, "
                                                 f"open_children = {parent['open_children']}", event_id, offset,
                                 diagnosis)
    for dim, balance in parent["dimensions"].items():
        if min(_balance_terms(balance)) < 0:
            term = next(term for term in model.BALANCE_TERMS if balance[term] < 0)
            raise InvariantViolation(parent_id, dim, f"{term} = {balance[term]} < 0", event_id, offset, diagnosis)
        held = sum(_held_terms(balance))
        if held != balance["capacity"] + balance["overdrawn"]:
            raise InvariantViolation(
                parent_id, dim, f"terms add up to {held}, capacity + overdrawn = "
                                f"{balance['capacity'] + balance['overdrawn']}: {balance}", event_id, offset,
                diagnosis)


def _holds(child: dict) -> str:
    term = model.holding_term(child["state"])
    if term is None:
        return "holds nothing"
    return f"holds {dict((dim, model.remainder(child, dim)) for dim in child['reserved'])} in {term}"


def describe_children(parent: dict, ctx: EventContext, view: LedgerView) -> str:
    """The ledger auditor's view of a broken parent: each child-derived term that disagrees with its children
    (model.held_by_children), and the children this event changed, with their states and remainders: where a
    remainder sits in the wrong term, one of them moved it."""
    children = [view.child(parent["parent_id"], child_id) for child_id in parent["children"]]
    derived = model.held_by_children(parent, [child for child in children if child is not None])
    wrong = [f"{dim}.{term} = {parent['dimensions'][dim][term]}, its children hold {quantity}"
             for dim, terms in derived.items() for term, quantity in terms.items()
             if parent["dimensions"][dim][term] != quantity]
    changed = [f"{child['child_id']} ({child['state']}, attempt {child['attempt_id']}, "
               + _holds(child) + ")"
               for child in ctx.touched_children.values() if child["parent_id"] == parent["parent_id"]]
    return (f"recomputed from the children: {'; '.join(wrong) or 'every child-derived term agrees'}; "
            f"children this event changed: {', '.join(changed) or 'none'}")


@cache
def _core_env() -> dict:
    """What the compiled core is given: the Python functions of its rare paths, and the contract's names and limits
    (it refuses to start where they differ from those it was written for)."""
    names = ("RESERVED", "ACTIVATED", "PARTIALLY_CONSUMED", "CANCEL_REQUESTED", "EXPIRED", "RECONCILING", "STRANDED",
             "COMMITTED", "RELEASED", "PARENT_OPEN", "PARENT_CLOSING", "PARENT_EXPIRED", "PARENT_CLOSED", "PHYSICAL",
             "LOAN_OPEN", "DESTINATION_PARENT", "DESTINATION_POOL", "TIMER_CHILD_LEASE", "TIMER_PARENT_RETENTION",
             "LOGICAL", "TIMER_PARENT_LEASE")
    codes = ("OK", "DUPLICATE", "IDEMPOTENCY_CONFLICT", "OVERDRAWN", "EXCEEDS_AVAILABLE", "FANOUT_EXCEEDED",
             "INVALID_TRANSITION", "DISPATCH_FENCED", "STALE_LEASE_GENERATION", "SUPERSEDED_ATTEMPT",
             "UNKNOWN_PARENT", "UNKNOWN_CHILD", "ALREADY_SETTLED", "INVALID_EVENT", "DUPLICATE_USAGE_REPORT",
             "LIMIT_EXCEEDED")
    contract = {name: getattr(model, name) for name in names}
    contract.update({name: getattr(results, name) for name in codes})
    contract["PARENT_CLOSED_CODE"] = results.PARENT_CLOSED
    contract.update({name: getattr(limits, name) for name in dir(limits) if name.startswith("MAX_")})
    contract.update(KEY_SEP=keys.SEP.decode(), KEY_PARENT=keys.PARENT.decode(), KEY_CHILD=keys.CHILD.decode(),
                    KEY_IDEMPOTENCY=keys.IDEMPOTENCY.decode(), PARENT_RECORD=ledger_view.PARENT_RECORD,
                    CHILD_RECORD=ledger_view.CHILD_RECORD, IDEMPOTENCY_RECORD=ledger_view.IDEMPOTENCY_RECORD,
                    NEW_RECORD_BYTES=ledger_view._NEW_RECORD_BYTES, ENTRY_BYTES=ledger_view._ENTRY_BYTES,
                    KEY_TIMER=keys.TIMER.decode(), DEADLINE_DIGITS=keys.DEADLINE_DIGITS,
                    TIMER_RECORD=ledger_view.TIMER_RECORD,
                    PARENT_OUTCOMES=",".join(sorted(validation.PARENT_OUTCOMES)))
    return {"contract": contract, "payload_digest": payload_digest, "closed_detail": handlers._closed_detail,
            "raise_violation": _raise_violation, "event_context": EventContext,
            "digest_writers": _digests, "decoded_size": ledger_view.decoded_size, "new_parent": model.new_parent}


def _change_writers(view: LedgerView) -> tuple[dict, object] | None:
    """(the compiled writer per record name, Codec.encode) of the codec the view encodes with, for FoldCore.changes;
    None unless the view's `encode` is a compiled Codec's own."""
    codec = getattr(view._encode, "__self__", None)
    if (not isinstance(codec, Codec) or codec.implementation != native.COMPILED
            or type(codec).encode is not Codec.encode or view._encode != codec.encode):
        return None
    encoder = native.module().Encoder
    return {name: w for name, w in codec.plain_encoders().items() if isinstance(w, encoder)}, codec.encode


class Fold:
    """Applies events of one input partition to its ledger.

    `partitions` is the input topic's partition count. Given, the fold is that of a topic partition: an event
    whose parent belongs to another partition is `misrouted`, and a Tick among the input events is
    `tick_not_accepted` (ledger time comes only from the processor's own ticks, folded by `tick`); both change
    nothing. None (a file of events, which has no partitions) folds every parent and the ticks in its lines."""

    def __init__(self, view: LedgerView, partition: int = 0, partitions: int | None = None,
                 implementation: str | None = None) -> None:
        self.view = view
        self.partition = partition
        self.partitions = partitions
        # schemas/native.py: the compiled core (native/src/fold.rs) takes the common events and gives every other
        # to `_apply`, the Python fold, which is the reference; `python` runs `_apply` alone.
        self.implementation = native.select(implementation)
        self._core = (native.module().FoldCore(self, _core_env()) if self.implementation == native.COMPILED
                      else None)
        self._change_writers = _change_writers(view) if self._core is not None else None

    def changes(self) -> list:
        """The view's changes for the checkpoint, as `LedgerView.changes` gives them: encoded by the compiled core
        where the fold and the view's codec are compiled, else by the view."""
        if self._change_writers is not None:
            return self._core.changes(*self._change_writers)
        return self.view.changes()

    def tick(self, event: dict, anchor: int, out: Outputs) -> dict:
        """Apply one of the processor's own Tick events, made before input offset `anchor`; as `apply`."""
        return self.apply(event, anchor, out, ledger_tick=True)

    def apply(self, event: dict, offset: int, out: Outputs, ledger_tick: bool = False) -> dict:
        """Apply one event; append its outputs to `out`; return its result record."""
        core = self._core
        if core is not None:
            return core.apply(self, event, offset, out, ledger_tick)
        return self._apply(event, offset, out, ledger_tick)

    def _apply(self, event: dict, offset: int, out: Outputs, ledger_tick: bool = False) -> dict:
        ctx = EventContext(event, self.partition, offset, self.view.meta["ledger_time_ms"], out)
        problem = validate(event)
        if problem is not None:
            code, detail = results.INVALID_EVENT, problem
        elif event["type"] == "Tick":
            if ledger_tick or self.partitions is None:
                code, detail = self._tick(ctx)
            else:
                code, detail = results.TICK_NOT_ACCEPTED, ("ledger time comes only from the processor's own "
                                                           "ticks (topic ledger-ticks): a Tick on the input "
                                                           "topic changes nothing")
        elif self.partitions is not None and partition_of(event["parent_id"], self.partitions) != self.partition:
            code, detail = results.MISROUTED, self._misrouted(event["parent_id"])
        else:
            code, detail = self._apply_once(ctx)
        for parent in ctx.touched.values():
            check_invariant(parent, ctx, self.view)
        result = {
            "event_id": event["event_id"],
            "idempotency_key": event["idempotency_key"],
            "parent_id": event["parent_id"],
            "child_id": event.get("child_id"),
            "event_type": event["type"],
            "result": code,
            "detail": detail,
            "input_partition": self.partition,
            "input_offset": offset,
            "ledger_time_ms": ctx.now_ms,
        }
        out.results.append(result)
        self.view.end_event()  # between events: the view may now trim its cache
        return result

    def _misrouted(self, parent_id: str) -> str:
        return (f"parent {parent_id!r} belongs to partition {partition_of(parent_id, self.partitions)} of "
                f"{self.partitions} (Kafka's murmur2 of the parent id), not {self.partition}: produce its events "
                "keyed by the parent id, to no explicit partition")

    def _apply_once(self, ctx: EventContext) -> tuple[str, str]:
        event = ctx.event
        parent_id, key = event["parent_id"], event["idempotency_key"]
        digest = payload_digest(event)
        stored = self.view.idempotency(parent_id, key)
        if stored is not None:
            if stored["payload_digest"] == digest:
                return results.DUPLICATE, f"original event {stored['event_id']} had result {stored['result']}"
            return results.IDEMPOTENCY_CONFLICT, (f"key {key!r} was used by event {stored['event_id']} "
                                                  f"({stored['event_type']}) with another payload")
        try:
            HANDLERS[event["type"]](ctx, self.view)
        except Reject as rejection:
            return rejection.code, rejection.detail
        code = results.OVERDRAWN if ctx.overdrawn else results.OK
        self.view.put_idempotency(parent_id, key, {
            "payload_digest": digest,
            "event_type": event["type"],
            "result": code,
            "event_id": event["event_id"],
        })
        return code, ""

    def _tick(self, ctx: EventContext) -> tuple[str, str]:
        event = ctx.event
        meta = self.view.meta
        now_ms = event["now_ms"]
        if now_ms <= meta["ledger_time_ms"]:
            if event["idempotency_key"] == meta["last_tick_key"]:
                return results.DUPLICATE, "this tick was already applied"
            return results.STALE_TICK, f"ledger time is already {meta['ledger_time_ms']}"
        first_tick = meta["last_tick_key"] is None
        meta["ledger_time_ms"] = now_ms
        meta["last_tick_key"] = event["idempotency_key"]
        self.view.put_meta()
        ctx.now_ms = now_ms
        if first_tick:
            rebase_timers(ctx, self.view, now_ms)
        marks, out = ctx.out.timer_marks, ctx.out
        for timer in self.view.pop_due_timers(now_ms):
            if marks is not None:
                marks.append((timer, len(out.releases), len(out.audits), len(out.settled)))
            fire_timer(ctx, self.view, *timer)
        self.view.drop_timers()  # those of the parents this tick compacted
        return results.OK, ""
