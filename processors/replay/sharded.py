"""One ledger folded in parent shards side by side: `settle replay FILE.jsonl` on several cores.

A JSON Lines file holds one ledger (ledger time is the whole file's, SPEC §7), so it cannot be split the way a
topic's partitions are. But the fold couples two parents only through ledger time: a parent changes by its
own events and by ticks, which pass the same deadlines for every parent. So `jobs` processes each fold the
events of the parents whose id hashes to them (CRC-32 of the UTF-8 id, modulo `jobs`) and every tick, into a
ledger of their own, and what they derive is merged back into what one fold gives, byte for byte
(tests/replay/test_replay_sharded.py):

- a non-tick event's result and releases come from its parent's shard;
- a tick's result is the same in every shard (same ledger time, same last tick): shard 0's is kept;
- a tick's expiries: each shard fires its own timers in the order one fold would, and one fold fires every
  timer in (deadline, kind, parent, child) order, so the shards' releases are merged in that order (the fold
  marks where each timer's outputs begin: `Outputs.timer_marks`);
- the shards' ledgers are disjoint by parent: the ledger is their union.

Routing without decoding: every shard reads the whole file and decodes only its own lines. A line's shard is
read from its raw bytes when they hold exactly one `"parent_id": "..."` with no escape in it: that is the
top-level field, since JSON escapes every quote inside a string and no field nested in an event is a string
named parent_id (a shard that decodes such a line into another parent's event raises rather than fold it).
Any other line is decoded by every shard, and kept by the one its parent hashes to (by all: a tick). A line
that is not an event is the dead letter of the shard its bytes name, or of shard 0.

What comes back is what `settle replay` prints (processors/replay/report.py, `replay.document`): every result and
release with the fields those reports show, the dead letters and the ledger; not the audit records and
`ParentSettled` summaries, which only the topic replay compares.
"""

from __future__ import annotations

import heapq
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.replay.workers import (_cores, gather_workers, send_outcome, start_workers,
                                                         stop_workers)
from branch_settlement.processors.replay.replayer import (ASIDE_MIN_BYTES, DEFAULT_CHECKPOINT_EVENTS, Replayer,
                                                          ReplayResult, _single_threaded, decode_json_line,
                                                          ledger_snapshot)
from branch_settlement.processors.replay.errors import ReplayError
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas.codec import Codec

# A top-level string field parent_id with no escape in it; the only match in a line names the line's shard.
_PARENT_ID = re.compile(rb'"parent_id"\s*:\s*"([^"\\]*)"')
_EVERY_SHARD = -1  # a tick's shard (and any line whose parent id is empty)
_UNKNOWN = -2  # decode to know
RELEASE_FIELDS = ("parent_id", "child_id", "dimension", "quantity", "destination", "reason")


def shard_of(parent_id: bytes, shards: int) -> int:
    return zlib.crc32(parent_id) % shards


def _shard_from_bytes(raw: bytes, shards: int) -> int:
    found = _PARENT_ID.findall(raw)
    if len(found) != 1:
        return _UNKNOWN
    return _EVERY_SHARD if not found[0] else shard_of(found[0], shards)


@dataclass
class Part:
    """What one shard derived: its results (offset, event id, result, detail), its releases with their place
    in one fold's order ((offset, timer or (), n-th of the shard), the release's reported fields), its dead
    letters, its events (ticks counted by shard 0 only) and its ledger."""

    results: list[tuple] = field(default_factory=list)
    releases: list[tuple] = field(default_factory=list)
    dead_letters: list[dict] = field(default_factory=list)
    events: int = 0
    ledger: dict = field(default_factory=dict)


def usable(path: str | os.PathLike, jobs: int | None) -> bool:
    """Whether a file replay folds in shards: a JSON Lines file of ASIDE_MIN_BYTES or more, more than one job,
    and a process that can fork (a single thread: a fork may inherit a lock another thread holds)."""
    import multiprocessing

    with open(path, "rb") as probe:
        if probe.read(4) == b"Obj\x01":
            return False  # an Avro container: its records have to be decoded to be routed
    return ((jobs or _cores()) > 1 and os.path.getsize(path) >= ASIDE_MIN_BYTES and _single_threaded()
            and "fork" in multiprocessing.get_all_start_methods())


def fold_shard(path: str | os.PathLike, codec: Codec, shard: int, shards: int,
               checkpoint_events: int = DEFAULT_CHECKPOINT_EVENTS, progress=None) -> Part:
    """Fold shard `shard` of `shards` of a JSON Lines file. `progress(n)`: told of every 1000 lines read (every
    shard reads the whole file, so one shard's lines are the replay's progress)."""
    replayer = Replayer(MemoryStore(), codec=codec, checkpoint_events=checkpoint_events)
    out: Outputs = replayer.result.outputs
    out.timer_marks = marks = []
    places: list[tuple] = []  # (offset, timer or ()) of each release, as they are made
    with open(path, "rb") as lines:
        offset = 0
        for number, raw in enumerate(lines, start=1):
            if progress is not None and number % 1000 == 0:
                progress(1000)
            if not raw.strip():
                continue
            offset += 1
            owner = _shard_from_bytes(raw, shards)
            if owner >= 0 and owner != shard:
                continue
            item = decode_json_line(raw, offset - 1, number, codec)
            event = item.event
            if event is None:
                if owner == shard or (owner < 0 and shard == 0):
                    replayer.feed(item)
                continue
            tick = event["type"] == "Tick" and not event["parent_id"]  # (one naming a parent is invalid: its shard's)
            if not tick:
                mine = shard_of(event["parent_id"].encode(), shards)
                if mine != shard:
                    if owner == shard:
                        raise ReplayError(f"line {number}: routed to shard {shard} by its bytes, but its parent "
                                          f"belongs to shard {mine}: replay it with --jobs 1")
                    continue
            before = len(out.releases)
            replayer.feed(item)
            if tick:
                if shard != 0:
                    out.results.pop()  # shard 0 reports the tick
                    replayer.result.events -= 1
                ends = [start for _, start, _, _ in marks[1:]] + [len(out.releases)]
                places.extend([(item.offset, ())] * ((marks[0][1] if marks else len(out.releases)) - before))
                for (timer, start, _, _), end in zip(marks, ends):
                    places.extend([(item.offset, timer)] * (end - start))
                marks.clear()
            else:
                places.extend([(item.offset, ())] * (len(out.releases) - before))
    result, store = replayer.finish()
    return Part(
        results=[(r["input_offset"], r["event_id"], r["result"], r["detail"]) for r in out.results],
        releases=[(offset, timer, n, tuple(release[f] for f in RELEASE_FIELDS))
                  for n, ((offset, timer), release) in enumerate(zip(places, out.releases))],
        dead_letters=result.dead_letters, events=result.events, ledger=ledger_snapshot(store, codec))


def merge(parts: list[Part]) -> tuple[ReplayResult, dict]:
    """The shards' parts as one fold's: a ReplayResult whose results and releases carry the fields the reports
    show, and the ledger."""
    results = [{"input_offset": offset, "event_id": event_id, "result": code, "detail": detail}
               for offset, event_id, code, detail in heapq.merge(*(part.results for part in parts))]
    releases = [dict(zip(RELEASE_FIELDS, values))
                for _, _, _, values in heapq.merge(*(part.releases for part in parts), key=lambda r: r[:3])]
    letters = list(heapq.merge(*(part.dead_letters for part in parts), key=lambda letter: letter["offset"]))
    parents: dict = {}
    children: dict = {}
    for part in parts:
        parents.update(part.ledger["parents"])
        children.update(part.ledger["children"])
    ledger = {"parents": dict(sorted(parents.items())), "children": dict(sorted(children.items()))}
    result = ReplayResult(Outputs(results=results, releases=releases), dead_letters=letters,
                          events=sum(part.events for part in parts))
    return result, ledger


def replay_jsonl(path: str | os.PathLike, codec: Codec, jobs: int | None = None,
                 checkpoint_events: int = DEFAULT_CHECKPOINT_EVENTS, progress=None) -> tuple[ReplayResult, dict]:
    """Fold a JSON Lines file in `jobs` parent shards (default: one per core), this process folding shard 0
    and forked processes the others; the merged result and ledger (see `merge`). `progress(n)`: lines read by
    this process's shard."""
    import multiprocessing

    shards = jobs or _cores()
    path = Path(path)
    if shards <= 1:
        return merge([fold_shard(path, codec, 0, 1, checkpoint_events, progress)])
    ctx = multiprocessing.get_context("fork")

    def work(shard: int, send) -> None:
        send_outcome(send, lambda: {shard: fold_shard(path, codec, shard, shards, checkpoint_events)})

    workers = []
    try:
        start_workers(workers, ctx, work, [(shard,) for shard in range(1, shards)])
        done = {0: fold_shard(path, codec, 0, shards, checkpoint_events, progress)}
        gather_workers(workers, done, ReplayError)
        return merge([done[shard] for shard in range(shards)])
    finally:
        stop_workers(workers)


def replay_file(path: str | os.PathLike, codec: Codec, jobs: int | None = None,
                checkpoint_events: int = DEFAULT_CHECKPOINT_EVENTS, progress=None) -> tuple[ReplayResult, dict]:
    """What `settle replay FILE` folds (a file that is not an export): in parent shards when `usable`, else in
    this process with the file decoded by a forked reader; the result and the ledger either way.
    `progress(n)`: told of the lines (or Avro records) read, by thousands."""
    from branch_settlement.processors.replay.replayer import read_events_aside, replay

    if usable(path, jobs):
        return replay_jsonl(path, codec, jobs, checkpoint_events, progress)
    inputs = read_events_aside(path, codec)
    if progress is not None:
        from branch_settlement.processors.replay.partitioned import _counting

        inputs = _counting(inputs, progress)
    result, store = replay(inputs, MemoryStore(), codec=codec,
                           checkpoint_events=checkpoint_events)
    return result, ledger_snapshot(store, codec)
