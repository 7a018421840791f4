"""LedgerView: what the fold reads and writes, between two checkpoints.

Reads go through a cache of decoded records to the store; writes change the cached records in place and
mark their keys dirty. Nothing reaches the store until the processor has committed the checkpoint's Kafka
transaction (see processors/kafka/checkpoint.py): `changes()` encodes the dirty records for the changelog and
the store batch, `mark_committed()` forgets them once written, `discard()` throws away everything not
committed (a transaction abort, a crash simulation, a restore).

The cache is bounded in bytes, process-wide: every view of a process shares one `CacheBudget`
(`DEFAULT_CACHE_BYTES` unless `set_cache_budget` says otherwise), and each view keeps its share of it (the
budget divided by the number of views). A record's cost is estimated from its encoded size (`decoded_size`),
so a parent of 64 children counts five times a child, as it weighs in memory. Whenever a view holds more
than its share after an event (`end_event`, which the fold calls) or after a checkpoint, it forgets the
records it cached first: a committed record is dropped (the store has it); a record changed since the last
commit is first encoded into the checkpoint's changes ("spilled"), where a later read finds it. So memory
stays bounded even within a checkpoint that touches more records than the cache holds (a partition's first
tick rebasing every lease, a burst of expiries), and eviction is invisible to the fold: a record read again
decodes to what was evicted. Only between events: during one, the fold holds the records it works on.

Timers (lease and reconciliation deadlines) are also kept in memory as a heap, loaded from the store when
the view opens, so a tick finds what is due without scanning storage. A timer is deleted when it fires;
one made stale by a renewal or a settlement fires harmlessly (the fold checks it against the record).
"""

from __future__ import annotations

import heapq
import weakref
from typing import Callable

from branch_settlement.projections import keys, model
from branch_settlement.projections.store import Change, Store

Encode = Callable[[str, dict], bytes]
Decode = Callable[[bytes], tuple[str, dict]]

PARENT_RECORD = "LedgerParent"
CHILD_RECORD = "LedgerChild"
IDEMPOTENCY_RECORD = "IdempotencyRecord"
TIMER_RECORD = "TimerRecord"
META_RECORD = "PartitionMeta"

# Estimated memory of the decoded records cached by all the views of a process together: with the ledger's
# RocksDB block cache (projections/store.py), what bounds the processor's memory whatever the ledger's size.
DEFAULT_CACHE_BYTES = 96 * 1024 * 1024

# Bytes of memory per encoded byte, by record kind (the key's first byte), measured with tracemalloc on decoded
# records of the benchmark's workloads (a parent weighs most: its children's ids are many small strings). Plus
# what any cached entry costs beyond its record: its key, its slots in the cache and the size table, the
# allocator's slack. Calibrated on RSS; the figures are in docs/benchmarks.md ("What a cached record costs").
_BYTES_PER_ENCODED_BYTE = {keys.PARENT[0]: 16, keys.CHILD[0]: 11, keys.IDEMPOTENCY[0]: 4}
_ENTRY_BYTES = 400
# A record put before it was ever encoded (a new child): estimated at the next checkpoint, which encodes it.
_NEW_RECORD_BYTES = 1024


def decoded_size(key: bytes, encoded_bytes: int) -> int:
    """Estimated memory of the cached record under `key` whose encoding is `encoded_bytes` long."""
    return _BYTES_PER_ENCODED_BYTE.get(key[0], 16) * encoded_bytes + _ENTRY_BYTES


class CacheBudget:
    """How many bytes of decoded records the LedgerViews sharing it may cache, all together (estimated by
    `decoded_size`); each view keeps to its share."""

    def __init__(self, size_bytes: int) -> None:
        if size_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, not {size_bytes}")
        self.bytes = size_bytes
        self._views: weakref.WeakSet[LedgerView] = weakref.WeakSet()
        self.share = size_bytes

    def add(self, view: LedgerView) -> None:
        self._views.add(view)
        self._reshare()

    def _reshare(self) -> None:
        self.share = self.bytes // max(len(self._views), 1)

    def cached_bytes(self) -> int:
        return sum(view.cached_bytes for view in list(self._views))

    def cached_records(self) -> int:
        return sum(len(view._cache) for view in list(self._views))

    def enforce(self) -> None:
        """Trim every view holding more than its share (between events only: see LedgerView.end_event)."""
        self._reshare()
        for view in list(self._views):
            view.end_event()


_process_budget = CacheBudget(DEFAULT_CACHE_BYTES)


def set_cache_budget(size_bytes: int) -> None:
    """The process-wide bound on cached records, in estimated bytes (every view, present and future, shares
    it)."""
    if size_bytes < 0:
        raise ValueError(f"cache budget must be >= 0 bytes, not {size_bytes}")
    _process_budget.bytes = size_bytes
    _process_budget.enforce()


def cache_budget() -> CacheBudget:
    return _process_budget

Timer = tuple[int, str, str, str]  # (deadline_ms, kind, parent_id, child_id): heap order = firing order

_ABSENT = object()


def parse_timer_key(key: bytes) -> Timer:
    _, deadline, kind, parent_id, child_id = key.split(keys.SEP)
    return int(deadline), kind.decode(), parent_id.decode(), child_id.decode()


class LedgerView:
    def __init__(self, store: Store, encode: Encode, decode: Decode, budget: CacheBudget | None = None) -> None:
        self.store = store
        self._encode = encode
        self._decode = decode
        self._cache: dict[bytes, dict | None] = {}  # in the order first cached: the oldest are evicted first
        self._sizes: dict[bytes, int] = {}  # estimated bytes of each cached entry
        self.cached_bytes = 0
        # Changed since the last commit, in the order first changed: (record name, the record or, once
        # spilled, for a timer or for an idempotency record, its encoding), or None for a delete.
        self._dirty: dict[bytes, tuple[str, dict | bytes] | None] = {}
        self._timers: list[Timer] = []
        self._dropping: set[str] = set()  # parents whose timers drop_timers deletes
        self.meta: dict = model.new_meta()
        self._budget = _process_budget if budget is None else budget
        self._budget.add(self)
        self._load_uncached_state()

    def _load_uncached_state(self) -> None:
        self._dropping = set()
        self._timers = [parse_timer_key(key) for key, _ in self.store.scan(keys.prefix(keys.TIMER))]
        heapq.heapify(self._timers)
        raw = self.store.get(keys.META_KEY)
        self.meta = model.new_meta() if raw is None else self._decode(raw)[1]

    def _get(self, key: bytes) -> dict | None:
        try:
            return self._cache[key]
        except KeyError:
            pass
        entry = self._dirty.get(key, _ABSENT)
        raw = self.store.get(key) if entry is _ABSENT else None if entry is None else entry[1]
        name, record = (None, None) if raw is None else self._decode(raw)
        self._cache[key] = record
        self._charge(key, _ENTRY_BYTES if raw is None else decoded_size(key, len(raw)))
        if record is not None and entry is not _ABSENT:
            self._dirty[key] = (name, record)  # spilled earlier: the record is the change again
        return record

    def _put(self, key: bytes, name: str, record: dict) -> None:
        cache = self._cache
        if cache.get(key) is not record:  # a new record: estimated until the checkpoint encodes it
            cache[key] = record
            self._charge(key, _NEW_RECORD_BYTES)
        self._dirty[key] = (name, record)

    def _charge(self, key: bytes, size: int) -> None:
        self.cached_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size

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
        """Encoded at once into the changes, as a spilled change, and out of the cache: an idempotency record is read
        again only for a duplicate (which decodes it), and cached, those of every event would push the ledger's
        parents and children out."""
        record_key = keys.idempotency_key(parent_id, key)
        self._uncache(record_key)  # looked up first, and cached as absent
        self._dirty[record_key] = (IDEMPOTENCY_RECORD, self._encode(IDEMPOTENCY_RECORD, record))

    def _uncache(self, key: bytes) -> None:
        if key in self._cache:
            del self._cache[key]
            self.cached_bytes -= self._sizes.pop(key)

    def _delete(self, key: bytes) -> None:
        self._uncache(key)
        self._dirty[key] = None

    def delete_child(self, parent_id: str, child_id: str) -> None:
        self._delete(keys.child_key(parent_id, child_id))

    def delete_idempotency_of(self, parent_id: str) -> int:
        """Delete every idempotency record of the parent (in the store or changed since the last commit), in key
        order; return how many."""
        prefix = keys.idempotency_key(parent_id, "")
        found = {key for key, _ in self.store.scan(prefix)}
        found.update(key for key, entry in self._dirty.items() if entry is not None and key.startswith(prefix))
        found.difference_update(key for key in found if self._dirty.get(key, _ABSENT) is None)
        for key in sorted(found):
            self._delete(key)
        return len(found)

    def put_meta(self) -> None:
        self._dirty[keys.META_KEY] = (META_RECORD, self.meta)

    # -- timers -------------------------------------------------------------------------------------------

    def add_timer(self, deadline_ms: int, kind: str, parent_id: str, child_id: str = "") -> None:
        timer = (deadline_ms, kind, parent_id, child_id)
        heapq.heappush(self._timers, timer)
        # Encoded at once: a timer never changes, and a tick that rebases every lease adds thousands.
        record = {"kind": kind, "deadline_ms": deadline_ms, "parent_id": parent_id, "child_id": child_id}
        self._dirty[keys.timer_key(*timer)] = (TIMER_RECORD, self._encode(TIMER_RECORD, record))

    def pop_due_timers(self, now_ms: int) -> list[Timer]:
        """Remove and return every timer with deadline <= now_ms, in firing order."""
        due = []
        while self._timers and self._timers[0][0] <= now_ms:
            timer = heapq.heappop(self._timers)
            self._dirty[keys.timer_key(*timer)] = None
            due.append(timer)
        return due

    def drop_timers_of(self, parent_id: str) -> None:
        """Delete every pending timer of the parent (a compacted parent's: none of them can fire any more). Done
        by `drop_timers` in one pass over the heap, once the tick has fired what was due."""
        self._dropping.add(parent_id)

    def drop_timers(self) -> int:
        """Delete the pending timers of the parents `drop_timers_of` named, in firing order; return how many."""
        dropping = self._dropping
        if not dropping:
            return 0
        timers = self._timers
        dropped = sorted(timer for timer in timers if timer[2] in dropping)
        if dropped:
            self._timers = [timer for timer in timers if timer[2] not in dropping]
            heapq.heapify(self._timers)
            for timer in dropped:
                self._dirty[keys.timer_key(*timer)] = None
        dropping.clear()
        return len(dropped)

    def pending_timer_count(self) -> int:
        return len(self._timers)

    # -- memory -------------------------------------------------------------------------------------------

    def end_event(self) -> None:
        """Between two events: if the cache holds more than this view's share, forget the records cached
        first (down to 7/8 of the share, so that the next events do not trim again at once)."""
        if self.cached_bytes > self._budget.share:
            self._trim(self._budget.share * 7 // 8)

    def _trim(self, target_bytes: int) -> None:
        cache, sizes, dirty = self._cache, self._sizes, self._dirty
        evicted = []
        for key in cache:
            if self.cached_bytes <= target_bytes:
                break
            entry = dirty.get(key)
            if entry is not None and type(entry[1]) is not bytes:
                dirty[key] = (entry[0], self._encode(*entry))  # spilled: the change is kept, encoded
            self.cached_bytes -= sizes.pop(key)
            evicted.append(key)
        for key in evicted:
            del cache[key]

    # -- checkpoint ---------------------------------------------------------------------------------------

    def has_changes(self) -> bool:
        return bool(self._dirty)

    def change_count(self) -> int:
        return len(self._dirty)

    def changes(self) -> list[Change]:
        """The checkpoint's changes, encoded, in the order they were first made (deterministic). The size
        of each cached record is estimated again from its encoding."""
        encode, sizes = self._encode, self._sizes
        changes = []
        for key, entry in self._dirty.items():
            if entry is None:
                changes.append((key, None))
                continue
            value = entry[1]
            if type(value) is not bytes:
                value = encode(entry[0], value)
                if key in sizes:
                    self._charge(key, decoded_size(key, len(value)))
            changes.append((key, value))
        return changes

    def mark_committed(self) -> None:
        """The changes are in the store: forget them (and trim the views holding more than their share)."""
        self._dirty.clear()
        self._budget.enforce()

    def discard(self) -> None:
        """Forget everything not committed to the store: the view is as if just opened."""
        self._dirty.clear()
        self._cache.clear()
        self._sizes.clear()
        self.cached_bytes = 0
        self._load_uncached_state()
