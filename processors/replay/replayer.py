"""Offline replay: fold a JSON Lines or Avro container file of events through the same fold as the
processor, with no broker. Used by `settle replay FILE`, by auditors, by tests and by benchmarks.

Each input becomes exactly one of: a result (the event was decoded; the fold may still reject it) or a
dead letter (it could not be decoded into an event: not JSON, not an object, unknown type, a field of the
wrong type). A bad line never stops the replay.

The replay checkpoints like the processor does (the view's changes are written to the store every
`checkpoint_events`), so a replay into a RocksDB directory exercises the same write path.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from branch_settlement.processors import gc_tuning
from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.auditor import AuditedFold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.projections import keys, model
from branch_settlement.projections.store import MemoryStore, Store
from branch_settlement.projections.view import LedgerView
from branch_settlement.schemas.codec import Codec, CodecError, default_codec
from branch_settlement.processors.replay.errors import ReplayError
from branch_settlement.schemas.limits import MAX_EVENT_BYTES

DEFAULT_CHECKPOINT_EVENTS = 10_000


@dataclass
class Input:
    """One input position: an event, or the reason it is not one."""

    offset: int  # 0-based position in the input (line index for JSON Lines); a ledger tick's: its anchor
    event: dict | None
    reason: str = ""
    line: int | None = None  # 1-based line number, for JSON Lines
    # One of the processor's own ticks (topic ledger-ticks), folded before input offset `offset`.
    ledger_tick: bool = False


def merge_ticks(inputs: Iterable[Input], ticks: Iterable[Input], end: int | None = None) -> Iterator[Input]:
    """A partition's inputs with its ledger ticks in the places the processor folded them: each tick (in
    the order of ledger-ticks) before the first input at or past its anchor; after the last input, the ticks
    anchored at most at `end` (where the input was read up to; None: every tick left)."""
    pending = iter(ticks)
    tick = next(pending, None)
    for item in inputs:
        while tick is not None and tick.offset <= item.offset:
            yield tick
            tick = next(pending, None)
        yield item
    while tick is not None and (end is None or tick.offset <= end):
        yield tick
        tick = next(pending, None)


@dataclass
class ReplayResult:
    outputs: Outputs
    dead_letters: list[dict] = field(default_factory=list)
    events: int = 0


def read_jsonl(path: str | Path, codec: Codec) -> Iterator[Input]:
    """Events of a JSON Lines file, one per non-blank line, with the line number of each."""
    with open(path, "rb") as lines:
        offset = 0
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            yield decode_json_line(raw, offset, number, codec)
            offset += 1


def decode_json_line(raw: bytes, offset: int, line: int | None, codec: Codec) -> Input:
    if len(raw) > MAX_EVENT_BYTES:
        return Input(offset, None, f"a line of {len(raw)} bytes: an event is at most {MAX_EVENT_BYTES}", line)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return Input(offset, None, f"not valid JSON: {getattr(err, 'msg', err)} at column {getattr(err, 'colno', '?')}", line)
    except RecursionError:
        return Input(offset, None, "not valid JSON for an event: nested too deeply", line)
    if not isinstance(obj, dict):
        return Input(offset, None, f"expected a JSON object, got {type(obj).__name__}", line)
    try:
        return Input(offset, codec.event_from_json(obj), line=line)
    except CodecError as err:
        return Input(offset, None, str(err), line)


def read_avro(path: str | Path, codec: Codec) -> Iterator[Input]:
    for offset, event in enumerate(codec.read_container(path)):
        yield Input(offset, event)


def read_events(path: str | Path, codec: Codec) -> Iterator[Input]:
    """JSON Lines or an Avro object container file, told apart by the container's magic bytes."""
    with open(path, "rb") as probe:
        magic = probe.read(4)
    if magic == b"Obj\x01":
        return read_avro(path, codec)
    return read_jsonl(path, codec)


# A file this large is read and decoded by a second process while this one folds (`read_events_aside`).
ASIDE_MIN_BYTES = 1 << 20
ASIDE_BATCH = 2_000


def read_events_aside(path: str | Path, codec: Codec, min_bytes: int = ASIDE_MIN_BYTES) -> Iterator[Input]:
    """`read_events(path)`, read and decoded in a forked process and handed over in pickled batches, so that
    decoding (about a fifth of a replay's work) runs on another core while the fold runs on this one. The
    same inputs in the same order. In this process when the file is small, when fork is not available, or
    when this process runs other threads (a fork may inherit a lock one of them holds)."""
    import multiprocessing

    if os.path.getsize(path) < min_bytes or not _single_threaded() or \
            "fork" not in multiprocessing.get_all_start_methods():
        yield from read_events(path, codec)
        return
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_read_aside, args=(str(path), codec, send), daemon=True)
    reader.start()
    send.close()
    try:
        while True:
            try:
                kind, payload = pickle.loads(receive.recv_bytes())
            except EOFError:
                reader.join(5)
                raise ReplayError(f"the process reading {path} died (exit code {reader.exitcode})") from None
            if kind == "inputs":
                for offset, event, reason, line in payload:
                    yield Input(offset, event, reason, line)
            elif kind == "error":
                raise ReplayError(f"reading {path}: {payload}")
            else:
                return
    finally:
        receive.close()
        reader.join(0.1)
        if reader.is_alive():
            reader.kill()
            reader.join()


def _read_aside(path: str, codec: Codec, send) -> None:
    try:
        batch = []
        for item in read_events(path, codec):
            batch.append((item.offset, item.event, item.reason, item.line))
            if len(batch) == ASIDE_BATCH:
                send.send_bytes(pickle.dumps(("inputs", batch), protocol=pickle.HIGHEST_PROTOCOL))
                batch = []
        send.send_bytes(pickle.dumps(("inputs", batch), protocol=pickle.HIGHEST_PROTOCOL))
        send.send_bytes(pickle.dumps(("end", None)))
    except BrokenPipeError:
        pass  # the replay stopped reading
    except Exception as exc:  # the message travels; the class may not unpickle
        send.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}")))
    finally:
        send.close()


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def open_view(store: Store, codec: Codec) -> LedgerView:
    return LedgerView(store, codec.encode, codec.decode)


def replay(
    inputs: Iterable[Input],
    store: Store | None = None,
    *,
    codec: Codec | None = None,
    partition: int = 0,
    partitions: int | None = None,
    checkpoint_events: int = DEFAULT_CHECKPOINT_EVENTS,
    audit_ledger: bool = False,
) -> tuple[ReplayResult, Store]:
    """Fold every input into `store` (a fresh MemoryStore by default); return the outputs and the store.
    `partitions`: the topic's partition count when the inputs are those of topic partition `partition`
    (processors/ledger/fold.py, Fold). `audit_ledger`: run the ledger auditor after every event
    (processors/ledger/auditor.py)."""
    replayer = Replayer(store, codec=codec, partition=partition, partitions=partitions,
                        checkpoint_events=checkpoint_events, audit_ledger=audit_ledger)
    feed = replayer.feed
    for item in inputs:
        feed(item)
    return replayer.finish()


class Replayer:
    """The replay of one partition, fed one input at a time (`replay` over an iterable; the topic replay as
    records arrive from the broker), so folding can start before the whole input is read."""

    def __init__(self, store: Store | None = None, *, codec: Codec | None = None, partition: int = 0,
                 partitions: int | None = None, checkpoint_events: int = DEFAULT_CHECKPOINT_EVENTS,
                 audit_ledger: bool = False) -> None:
        self.codec = codec or default_codec()
        self.store = store if store is not None else MemoryStore()
        self.view = open_view(self.store, self.codec)
        self.fold = (AuditedFold(self.view, partition, partitions=partitions) if audit_ledger
                     else Fold(self.view, partition, partitions))
        self.result = ReplayResult(Outputs())
        self.checkpoint_events = checkpoint_events
        self.since_checkpoint = 0
        self.last_offset = self.store.changelog_offset()

    def feed(self, item: Input) -> None:
        if item.event is None:
            self.result.dead_letters.append({"line": item.line, "event_id": None, "offset": item.offset,
                                             "reason": item.reason})
            return
        self.fold.apply(item.event, item.offset, self.result.outputs, item.ledger_tick)
        self.result.events += 1
        if not item.ledger_tick:
            self.last_offset = item.offset
        self.since_checkpoint += 1
        if self.since_checkpoint >= self.checkpoint_events:
            _checkpoint(self.fold, self.store, self.last_offset)
            self.since_checkpoint = 0

    def finish(self, write_store: bool = True) -> tuple[ReplayResult, Store]:
        """The outputs and the store, with the last changes written to it; `write_store=False` when nothing
        will read the store (the topic replay comparing outputs only): the store then lacks them."""
        if write_store:
            _checkpoint(self.fold, self.store, self.last_offset)
        return self.result, self.store


def _checkpoint(fold: Fold, store: Store, offset: int) -> None:
    store.write(fold.changes(), offset)
    fold.view.mark_committed()
    # The derived outputs and the cached ledger only grow or are freed by reference counting: out of the cyclic
    # collector's sight, its collections stay short (processors/gc_tuning.py).
    gc_tuning.after_checkpoint()


def ledger_snapshot(store: Store, codec: Codec) -> dict:
    """The ledger as SPEC §12 shows it: parents with balances, children with their state."""
    parents = dict(parent_entry(codec.decode(raw)[1]) for _, raw in store.scan(keys.prefix(keys.PARENT)))
    children = dict(child_entry(codec.decode(raw)[1]) for _, raw in store.scan(keys.prefix(keys.CHILD)))
    return {"parents": dict(sorted(parents.items())), "children": dict(sorted(children.items()))}


def parent_entry(parent: dict) -> tuple[str, dict]:
    """(parent id, what the ledger shows of the parent). A parent that lent shows its loans too, by loan id in
    the order lent (one that never lent has no `loans` key: its bytes are those of before borrowing)."""
    entry = {
        "status": parent["status"],
        "dimensions": {
            dim: {term: balance[term] for term in model.BALANCE_TERMS} for dim, balance in sorted(parent["dimensions"].items())
        },
    }
    if parent.get("loans"):
        entry["loans"] = {loan["loan_id"]: {"borrower": loan["borrower"], "quantities": dict(loan["quantities"]),
                                            "state": loan["state"], "revocation_requested": loan["revocation_requested"],
                                            "usage": dict(loan["usage"])}
                          for loan in parent["loans"]}
    return parent["parent_id"], entry


def child_entry(child: dict) -> tuple[str, dict]:
    """("parent/child", what the ledger shows of the child)."""
    return f"{child['parent_id']}/{child['child_id']}", {
        "state": child["state"],
        "attempt_id": child["attempt_id"],
        "reserved": dict(sorted(child["reserved"].items())),
        "consumed": dict(sorted(child["consumed"].items())),
        "lease_generation": child["lease_generation"],
    }


def replay_document(result: ReplayResult, store: Store, codec: Codec) -> dict:
    """The whole replay as one JSON document (SPEC §12 `settle replay --json`), in a stable order."""
    return document(result, ledger_snapshot(store, codec))


def document(result: ReplayResult, ledger: dict) -> dict:
    """`replay_document` of a ledger already snapshotted."""
    doc = dict(ledger)
    doc["results"] = [{"event_id": res["event_id"], "result": res["result"]} for res in result.outputs.results]
    doc["releases"] = [
        {key: rel[key] for key in ("parent_id", "child_id", "dimension", "quantity", "destination", "reason")}
        for rel in result.outputs.releases
    ]
    doc["dead_letters"] = [
        {"line": letter["line"], "reason": letter["reason"]} if letter["line"] is not None
        else {"event_id": letter["event_id"], "reason": letter["reason"]}
        for letter in result.dead_letters
    ]
    return doc
