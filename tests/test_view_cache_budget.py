"""The view cache's process-wide budget: evicting decoded records never changes what the fold does, and the
views of a process together hold no more than the budget after each checkpoint."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from processors.fold import Fold
from processors.outputs import Outputs
from processors.workload import Generator
from projections import view as view_module
from projections.store import MemoryStore, RocksStore
from projections.view import CacheBudget, LedgerView
from schemas.codec import default_codec

pytestmark = pytest.mark.unit

PARTITIONS = 3
OUTPUT_RECORDS = (("results", "SettlementResult"), ("releases", "CapacityReleased"), ("audits", "AuditRecord"),
                  ("settled", "ParentSettled"))


def fold_partitioned(budget: CacheBudget | None, stores: list, events: int = 3000, checkpoint_events: int = 40):
    """The seeded workload over PARTITIONS views (ticks to every one), checkpointing as the processor does:
    every view's changes taken, then each view's buffers forgotten, then the stores written. Returns every
    encoded output and change in order, and the largest number of records the views held after a checkpoint."""
    codec = default_codec()
    views = [LedgerView(store, codec.encode, codec.decode, budget) for store in stores]
    folds = [Fold(view, p) for p, view in enumerate(views)]
    outs = [Outputs() for _ in views]
    offsets = [0] * len(views)
    encoded: list[tuple[int, str, bytes]] = []
    most_cached = 0

    def checkpoint() -> None:
        nonlocal most_cached
        changes = []
        for p, view in enumerate(views):
            for attr, name in OUTPUT_RECORDS:
                encoded.extend((p, name, codec.encode(name, record)) for record in getattr(outs[p], attr))
            outs[p].clear()
            changes.append(view.changes())
            encoded.extend((p, "change", key + b"=" + (value or b"<deleted>")) for key, value in changes[-1])
        for view in views:
            view.mark_committed()
        for p, store in enumerate(stores):
            store.write(changes[p], offsets[p])
        if budget is not None:
            most_cached = max(most_cached, sum(len(view._cache) for view in views))

    for n, item in enumerate(Generator(11).generate(events)):
        if isinstance(item, str):
            continue
        event = codec.event_from_json(item)
        targets = (range(len(views)) if event["type"] == "Tick"
                   else [zlib.crc32(event["parent_id"].encode()) % len(views)])
        for p in targets:
            folds[p].apply(event, offsets[p], outs[p])
            offsets[p] += 1
        if n % checkpoint_events == 0:
            checkpoint()
    checkpoint()
    return encoded, most_cached


def ledger_bytes(store) -> list[tuple[bytes, bytes]]:
    return [(key, value) for prefix in (b"p", b"c", b"i", b"t", b"m") for key, value in store.scan(prefix)]


@pytest.mark.parametrize("records", [0, 7, 300])
def test_a_small_budget_changes_no_output_and_no_ledger_byte(records: int) -> None:
    unbounded, _ = fold_partitioned(CacheBudget(10**9), stores := [MemoryStore() for _ in range(PARTITIONS)])
    bounded_stores = [MemoryStore() for _ in range(PARTITIONS)]
    bounded, most_cached = fold_partitioned(CacheBudget(records), bounded_stores)
    assert bounded == unbounded
    assert [ledger_bytes(s) for s in bounded_stores] == [ledger_bytes(s) for s in stores]
    assert most_cached <= records


def test_the_budget_holds_with_rocksdb_and_evicted_records_read_back_equal(tmp_path: Path) -> None:
    reference, _ = fold_partitioned(CacheBudget(10**9), [MemoryStore() for _ in range(PARTITIONS)], events=1500)
    stores = [RocksStore(tmp_path / f"partition-{p}") for p in range(PARTITIONS)]
    try:
        bounded, most_cached = fold_partitioned(CacheBudget(50), stores, events=1500)
    finally:
        for store in stores:
            store.close()
    assert bounded == reference
    assert most_cached <= 50


def test_the_budget_is_shared_by_every_view_not_per_view() -> None:
    codec = default_codec()
    budget = CacheBudget(100)
    views = [LedgerView(MemoryStore(), codec.encode, codec.decode, budget) for _ in range(4)]
    for n, view in enumerate(views):
        for i in range(80):
            view.child(f"P{n}", f"c{i}")  # misses are cached too (as None)
    assert budget.cached() == 320
    views[0].mark_committed()
    assert budget.cached() <= 100
    assert all(len(view._cache) <= 25 for view in views)
    # the records cached last are the ones kept
    assert list(views[1]._cache)[-1].endswith(b"c79")


def test_a_view_with_uncommitted_changes_is_not_trimmed_by_another() -> None:
    codec = default_codec()
    budget = CacheBudget(10)
    busy, other = (LedgerView(MemoryStore(), codec.encode, codec.decode, budget) for _ in range(2))
    for i in range(30):
        busy.child("P", f"c{i}")
        other.child("Q", f"c{i}")
    busy.put_meta()  # something uncommitted
    other.mark_committed()
    assert len(busy._cache) == 30 and len(other._cache) == 5
    busy.mark_committed()
    assert budget.cached() <= 10


def test_set_cache_budget_is_process_wide() -> None:
    codec = default_codec()
    before = view_module.cache_budget().records
    try:
        view_module.set_cache_budget(12)
        views = [LedgerView(MemoryStore(), codec.encode, codec.decode) for _ in range(3)]
        for view in views:
            for i in range(20):
                view.parent(f"P{i}")
        views[2].mark_committed()
        assert sum(len(view._cache) for view in views) <= 12
        with pytest.raises(ValueError):
            view_module.set_cache_budget(-1)
    finally:
        view_module.set_cache_budget(before)
