"""The view cache's process-wide budget in estimated bytes: evicting decoded records, committed or not,
never changes what the fold does, and every view keeps to its share of the budget between events."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.workload import Generator
from branch_settlement.projections import view as view_module
from branch_settlement.projections.store import MemoryStore, RocksStore
from branch_settlement.projections.view import CacheBudget, LedgerView
from branch_settlement.projections import keys
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import Codec, default_codec
from branch_settlement.processors.ledger.outputs import OUTPUT_ROUTES

pytestmark = pytest.mark.unit

PARTITIONS = 3
# (Outputs list, record name), from the one routing table.
OUTPUT_RECORDS = tuple((attr, name) for attr, _, name in OUTPUT_ROUTES)


def fold_partitioned(budget: CacheBudget | None, stores: list, events: int = 3000, checkpoint_events: int = 40,
                     items=None):
    """The seeded workload (or `items`) over PARTITIONS views (ticks to every one), checkpointing as the
    processor does: every view's changes taken, then each view's buffers forgotten, then the stores written.
    Returns every encoded output and change in order, and the most estimated bytes one view held between two
    events."""
    codec = default_codec()
    views = [LedgerView(store, codec.encode, codec.decode, budget) for store in stores]
    folds = [Fold(view, p) for p, view in enumerate(views)]
    outs = [Outputs() for _ in views]
    offsets = [0] * len(views)
    encoded: list[tuple[int, str, bytes]] = []
    most_cached = 0

    def checkpoint() -> None:
        changes = []
        for p, view in enumerate(views):
            for attr, name in OUTPUT_RECORDS:
                encoded.extend((p, name, codec.encode(name, record)) for record in getattr(outs[p], attr))
            outs[p].clear()
            changes.append(folds[p].changes())  # the compiled core's encoding, where the fold is compiled
            encoded.extend((p, "change", key + b"=" + (value or b"<deleted>")) for key, value in changes[-1])
        for view in views:
            view.mark_committed()
        for p, store in enumerate(stores):
            store.write(changes[p], offsets[p])

    for n, item in enumerate(Generator(11).generate(events) if items is None else items):
        if isinstance(item, str):
            continue
        event = codec.event_from_json(item)
        targets = (range(len(views)) if event["type"] == "Tick"
                   else [zlib.crc32(event["parent_id"].encode()) % len(views)])
        for p in targets:
            folds[p].apply(event, offsets[p], outs[p])
            offsets[p] += 1
            most_cached = max(most_cached, views[p].cached_bytes)
        if n % checkpoint_events == 0:
            checkpoint()
    checkpoint()
    return encoded, most_cached


def ledger_bytes(store) -> list[tuple[bytes, bytes]]:
    return [(key, value) for prefix in (b"p", b"c", b"i", b"t", b"m") for key, value in store.scan(prefix)]


@pytest.mark.parametrize("budget_bytes", [0, 20_000, 300_000])
def test_a_small_budget_changes_no_output_and_no_ledger_byte(budget_bytes: int) -> None:
    unbounded, _ = fold_partitioned(CacheBudget(10**12), stores := [MemoryStore() for _ in range(PARTITIONS)])
    bounded_stores = [MemoryStore() for _ in range(PARTITIONS)]
    budget = CacheBudget(budget_bytes)
    bounded, most_cached = fold_partitioned(budget, bounded_stores)
    assert bounded == unbounded
    assert [ledger_bytes(s) for s in bounded_stores] == [ledger_bytes(s) for s in stores]
    assert most_cached <= budget.share


def test_the_budget_holds_with_rocksdb_and_evicted_records_read_back_equal(tmp_path: Path) -> None:
    reference, _ = fold_partitioned(CacheBudget(10**12), [MemoryStore() for _ in range(PARTITIONS)], events=1500)
    stores = [RocksStore(tmp_path / f"partition-{p}") for p in range(PARTITIONS)]
    budget = CacheBudget(50_000)
    try:
        bounded, most_cached = fold_partitioned(budget, stores, events=1500)
    finally:
        for store in stores:
            store.close()
    assert bounded == reference
    assert most_cached <= budget.share


def leases_before_the_first_tick(parents: int, children: int) -> list[dict]:
    """Parents and children reserved before any tick, then one tick: it rebases every lease (a ledger fill
    published before a processor ran), touching every parent in one event."""
    items = []
    for n in range(parents):
        parent_id = f"P{n:04d}"
        items.append({"type": "ParentReserved", "event_id": f"{parent_id}-r", "idempotency_key": f"{parent_id}/r",
                      "parent_id": parent_id, "occurred_at_ms": 1,
                      "capacity": {"tokens": {"quantity": 100 * children, "kind": "logical"}}, "lease_ttl_ms": 60_000,
                      "policy": {"max_live_children": children, "reconciliation_timeout_ms": 1000,
                                 "lending_limit": {}}})
        items.extend({"type": "ChildReserved", "event_id": f"{parent_id}-c{c}", "idempotency_key": f"{parent_id}/c{c}",
                      "parent_id": parent_id, "occurred_at_ms": 1, "child_id": f"c{c}", "branch_id": f"c{c}",
                      "attempt_id": f"c{c}-a1", "quantities": {"tokens": 100}} for c in range(children))
    items.append({"type": "Tick", "event_id": "t1", "idempotency_key": "tick/1", "parent_id": "", "occurred_at_ms": 1,
                  "now_ms": 1_000})
    items.append({"type": "Tick", "event_id": "t2", "idempotency_key": "tick/2", "parent_id": "", "occurred_at_ms": 1,
                  "now_ms": 100_000})  # every parent's lease expires: each fences its children
    return items


def test_one_tick_touching_every_parent_spills_its_changes_and_changes_nothing() -> None:
    items = leases_before_the_first_tick(parents=150, children=16)
    reference, _ = fold_partitioned(CacheBudget(10**12), stores := [MemoryStore() for _ in range(PARTITIONS)],
                                    checkpoint_events=10**9, items=items)
    budget = CacheBudget(60_000)  # a few parents' worth per view: most changes are spilled before the checkpoint
    bounded_stores = [MemoryStore() for _ in range(PARTITIONS)]
    bounded, most_cached = fold_partitioned(budget, bounded_stores, checkpoint_events=10**9, items=items)
    assert bounded == reference
    assert [ledger_bytes(s) for s in bounded_stores] == [ledger_bytes(s) for s in stores]
    assert most_cached <= budget.share


def new_parent(parent_id: str) -> dict:
    return {"parent_id": parent_id, "status": "open", "outcome": None, "lease_expires_at_ms": 5,
            "max_live_children": 4, "reconciliation_timeout_ms": 10, "lending_limit": {}, "live_children": 0,
            "open_children": 0, "children": ["c1", "c2"], "winners": {}, "dimensions": {}, "loans": [],
            "closed_at_ms": None, "compacted_at_ms": None}


def test_a_spilled_change_is_read_back_and_committed_as_it_was() -> None:
    codec = default_codec()
    budget = CacheBudget(10**12)
    view = LedgerView(MemoryStore(), codec.encode, codec.decode, budget)
    parent = new_parent("P")
    view.put_parent(parent)
    budget.bytes = 0
    budget.enforce()  # between events: the uncommitted parent is spilled, not lost
    assert view.cached_bytes == 0 and not view._cache
    again = view.parent("P")
    assert again == parent and again is not parent
    again["live_children"] = 1  # changed in place (and put, as the fold does): that is what gets committed
    view.put_parent(again)
    assert view.changes() == [(b"p\x00P", codec.encode("LedgerParent", again))]


def test_the_budget_is_shared_by_every_view_not_per_view() -> None:
    codec = default_codec()
    budget = CacheBudget(100_000)
    views = [LedgerView(MemoryStore(), codec.encode, codec.decode, budget) for _ in range(4)]
    for n, view in enumerate(views):
        for i in range(200):
            view.child(f"P{n}", f"c{i}")  # misses are cached too (as None)
    assert budget.cached_records() == 800 and budget.cached_bytes() > 100_000
    views[0].mark_committed()
    assert budget.cached_bytes() <= 100_000
    assert all(view.cached_bytes <= 25_000 for view in views)
    # the records cached last are the ones kept
    assert list(views[1]._cache)[-1].endswith(b"c199")


def test_set_cache_budget_is_process_wide() -> None:
    codec = default_codec()
    before = view_module.cache_budget().bytes
    try:
        view_module.set_cache_budget(12_000)
        views = [LedgerView(MemoryStore(), codec.encode, codec.decode) for _ in range(3)]
        for view in views:
            for i in range(100):
                view.parent(f"P{i}")
        views[2].mark_committed()
        assert sum(view.cached_bytes for view in views) <= 12_000
        with pytest.raises(ValueError):
            view_module.set_cache_budget(-1)
    finally:
        view_module.set_cache_budget(before)


@pytest.mark.parametrize("implementation", [native.PYTHON, native.COMPILED])
def test_an_idempotency_record_is_a_change_at_once_and_never_cached(implementation: str) -> None:
    """Each applied event writes one: encoded into the changes as it is written, so the cache keeps the parents and
    children; a duplicate in the same checkpoint still finds it (decoded from the change), then in the store."""
    if implementation == native.COMPILED and native.module() is None:
        pytest.fail("the compiled implementation is not installed: `make install` builds it (native/)")
    codec = Codec(implementation=implementation)
    view = LedgerView(MemoryStore(), codec.encode, codec.decode, CacheBudget(10**12))
    fold, out = Fold(view, implementation=implementation), Outputs()
    items = [codec.event_from_json(item) for item in Generator(5).generate(40) if not isinstance(item, str)]
    reserved = next(event for event in items if event["type"] == "ChildReserved")
    parent = next(event for event in items if event["type"] == "ParentReserved"
                  and event["parent_id"] == reserved["parent_id"])
    fold.apply(parent, 0, out)
    assert fold.apply(reserved, 1, out)["result"] == "ok"
    key = keys.idempotency_key(reserved["parent_id"], reserved["idempotency_key"])
    assert key not in view._cache and key not in view._sizes  # the lookup's "absent" is gone with it
    name, value = view._dirty[key]
    assert name == "IdempotencyRecord" and type(value) is bytes
    assert codec.decode(value)[1]["event_id"] == reserved["event_id"]
    assert fold.apply(dict(reserved, event_id="again"), 2, out)["result"] == "duplicate"
    changes = fold.changes()
    assert (key, value) in changes
    view.store.write(changes, 2)
    view.mark_committed()
    view.discard()  # nothing cached: read from the store
    assert fold.apply(dict(reserved, event_id="later"), 3, out)["result"] == "duplicate"
