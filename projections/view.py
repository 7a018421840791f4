"""LedgerView: what the fold reads and writes, between two checkpoints.

Reads go through a cache of decoded records to the store; writes change the cached records in place and
mark their keys dirty. Nothing reaches the store until the processor has committed the checkpoint's Kafka
transaction (see processors/checkpoint.py): `changes()` encodes the dirty records for the changelog and
the store batch, `mark_committed()` forgets them once written, `discard()` throws away everything not
committed (a transaction abort, a crash simulation, a restore).

Timers (lease and reconciliation deadlines) are also kept in memory as a heap, loaded from the store when
the view opens, so a tick finds what is due without scanning storage. A timer is deleted when it fires;
one made stale by a renewal or a settlement fires harmlessly (the fold checks it against the record).
"""

from __future__ import annotations

import heapq
from typing import Callable

from projections import keys, model
from projections.store import Change, Store

Encode = Callable[[str, dict], bytes]
Decode = Callable[[bytes], tuple[str, dict]]

PARENT_RECORD = "LedgerParent"
CHILD_RECORD = "LedgerChild"
IDEMPOTENCY_RECORD = "IdempotencyRecord"
TIMER_RECORD = "TimerRecord"
META_RECORD = "PartitionMeta"

# Decoded records kept between checkpoints; past this the cache is dropped after a commit (the store
# has everything by then), so memory stays bounded whatever the ledger's size.
MAX_CACHED_RECORDS = 50_000

Timer = tuple[int, str, str, str]  # (deadline_ms, kind, parent_id, child_id): heap order = firing order


def parse_timer_key(key: bytes) -> Timer:
    _, deadline, kind, parent_id, child_id = key.split(keys.SEP)
    return int(deadline), kind.decode(), parent_id.decode(), child_id.decode()


class LedgerView:
    def __init__(self, store: Store, encode: Encode, decode: Decode) -> None:
        self.store = store
        self._encode = encode
        self._decode = decode
        self._cache: dict[bytes, dict | None] = {}
        self._dirty: dict[bytes, tuple[str, dict] | None] = {}
        self._timers: list[Timer] = []
        self.meta: dict = model.new_meta()
        self._load_uncached_state()

    def _load_uncached_state(self) -> None:
        self._timers = [parse_timer_key(key) for key, _ in self.store.scan(keys.prefix(keys.TIMER))]
        heapq.heapify(self._timers)
        raw = self.store.get(keys.META_KEY)
        self.meta = model.new_meta() if raw is None else self._decode(raw)[1]

    def _get(self, key: bytes) -> dict | None:
        try:
            return self._cache[key]
        except KeyError:
            raw = self.store.get(key)
            record = None if raw is None else self._decode(raw)[1]
            self._cache[key] = record
            return record

    def _put(self, key: bytes, name: str, record: dict) -> None:
        self._cache[key] = record
        self._dirty[key] = (name, record)

    # -- records ------------------------------------------------------------------------------------------

    def parent(self, parent_id: str) -> dict | None:
        return self._get(keys.parent_key(parent_id))

    def put_parent(self, parent: dict) -> None:
        self._put(keys.parent_key(parent["parent_id"]), PARENT_RECORD, parent)

    def child(self, parent_id: str, child_id: str) -> dict | None:
        return self._get(keys.child_key(parent_id, child_id))

    def put_child(self, child: dict) -> None:
        self._put(keys.child_key(child["parent_id"], child["child_id"]), CHILD_RECORD, child)

    def idempotency(self, parent_id: str, key: str) -> dict | None:
        return self._get(keys.idempotency_key(parent_id, key))

    def put_idempotency(self, parent_id: str, key: str, record: dict) -> None:
        self._put(keys.idempotency_key(parent_id, key), IDEMPOTENCY_RECORD, record)

    def put_meta(self) -> None:
        self._dirty[keys.META_KEY] = (META_RECORD, self.meta)

    # -- timers -------------------------------------------------------------------------------------------

    def add_timer(self, deadline_ms: int, kind: str, parent_id: str, child_id: str = "") -> None:
        timer = (deadline_ms, kind, parent_id, child_id)
        heapq.heappush(self._timers, timer)
        record = {"kind": kind, "deadline_ms": deadline_ms, "parent_id": parent_id, "child_id": child_id}
        self._dirty[keys.timer_key(*timer)] = (TIMER_RECORD, record)

    def pop_due_timers(self, now_ms: int) -> list[Timer]:
        """Remove and return every timer with deadline <= now_ms, in firing order."""
        due = []
        while self._timers and self._timers[0][0] <= now_ms:
            timer = heapq.heappop(self._timers)
            self._dirty[keys.timer_key(*timer)] = None
            due.append(timer)
        return due

    def pending_timer_count(self) -> int:
        return len(self._timers)

    # -- checkpoint ---------------------------------------------------------------------------------------

    def has_changes(self) -> bool:
        return bool(self._dirty)

    def changes(self) -> list[Change]:
        """The checkpoint's changes, encoded, in the order they were first made (deterministic)."""
        encode = self._encode
        return [
            (key, None if entry is None else encode(entry[0], entry[1])) for key, entry in self._dirty.items()
        ]

    def mark_committed(self) -> None:
        """The changes are in the store: forget them (and the cache, if it grew too large)."""
        self._dirty.clear()
        if len(self._cache) > MAX_CACHED_RECORDS:
            self._cache.clear()

    def discard(self) -> None:
        """Forget everything not committed to the store: the view is as if just opened."""
        self._dirty.clear()
        self._cache.clear()
        self._load_uncached_state()
