"""LedgerView: what the fold reads and writes, between two checkpoints.

Reads go through a cache of decoded records to the store; writes change the cached records in place and
mark their keys dirty. Nothing reaches the store until the processor has committed the checkpoint's Kafka
transaction (see processors/checkpoint.py): `changes()` encodes the dirty records for the changelog and
the store batch, `mark_committed()` forgets them once written, `discard()` throws away everything not
committed (a transaction abort, a crash simulation, a restore).

The cache is bounded process-wide, not per view: every view of a process shares one `CacheBudget` (a
number of decoded records, `DEFAULT_CACHE_RECORDS` unless `set_cache_budget` says otherwise). When a view
has committed a checkpoint and the views together hold more than the budget, each view with nothing
uncommitted is trimmed to its share (the budget divided by the number of views), oldest entries first. A
process owning 8 partitions or 64 holds the same number of records. Eviction is invisible to the fold:
only committed records are evicted, and the store returns the same bytes for them.

Timers (lease and reconciliation deadlines) are also kept in memory as a heap, loaded from the store when
the view opens, so a tick finds what is due without scanning storage. A timer is deleted when it fires;
one made stale by a renewal or a settlement fires harmlessly (the fold checks it against the record).
"""

from __future__ import annotations

import heapq
import weakref
from itertools import islice
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

# Decoded records cached by all the views of a process together. A cached record costs about 0.85 KB as
# Python objects (a reserved child is two records: the child and its idempotency record), so 100k records
# are ~85 MB of RSS, whatever the ledger's size and the number of partitions the process owns.
DEFAULT_CACHE_RECORDS = 100_000


class CacheBudget:
    """How many decoded records the LedgerViews sharing it may cache, all together."""

    def __init__(self, records: int) -> None:
        self.records = records
        self._views: weakref.WeakSet[LedgerView] = weakref.WeakSet()

    def add(self, view: LedgerView) -> None:
        self._views.add(view)

    def cached(self) -> int:
        return sum(len(view._cache) for view in list(self._views))

    def enforce(self) -> None:
        """If the views hold more than the budget, trim each one over its share that has nothing
        uncommitted (a view between two checkpoints keeps what its uncommitted events may still use)."""
        views = list(self._views)
        if not views or sum(len(view._cache) for view in views) <= self.records:
            return
        share = self.records // len(views)
        for view in views:
            if not view._dirty and len(view._cache) > share:
                view._evict(len(view._cache) - share)


_process_budget = CacheBudget(DEFAULT_CACHE_RECORDS)


def set_cache_budget(records: int) -> None:
    """The process-wide bound on cached records (every view, present and future, shares it)."""
    if records < 0:
        raise ValueError(f"cache budget must be >= 0 records, not {records}")
    _process_budget.records = records
    _process_budget.enforce()


def cache_budget() -> CacheBudget:
    return _process_budget

Timer = tuple[int, str, str, str]  # (deadline_ms, kind, parent_id, child_id): heap order = firing order


def parse_timer_key(key: bytes) -> Timer:
    _, deadline, kind, parent_id, child_id = key.split(keys.SEP)
    return int(deadline), kind.decode(), parent_id.decode(), child_id.decode()


class LedgerView:
    def __init__(self, store: Store, encode: Encode, decode: Decode, budget: CacheBudget | None = None) -> None:
        self.store = store
        self._encode = encode
        self._decode = decode
        self._cache: dict[bytes, dict | None] = {}
        self._dirty: dict[bytes, tuple[str, dict] | None] = {}
        self._timers: list[Timer] = []
        self.meta: dict = model.new_meta()
        self._budget = _process_budget if budget is None else budget
        self._budget.add(self)
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
        """The changes are in the store: forget them (and trim the caches if they hold more than the budget)."""
        self._dirty.clear()
        self._budget.enforce()

    def _evict(self, count: int) -> None:
        """Forget the `count` records cached first (committed records only: the store has them)."""
        cache = self._cache
        for key in list(islice(cache, count)):
            del cache[key]

    def discard(self) -> None:
        """Forget everything not committed to the store: the view is as if just opened."""
        self._dirty.clear()
        self._cache.clear()
        self._load_uncached_state()
