"""One contract, two stores: the in-memory twin must behave exactly like RocksDB."""

from __future__ import annotations

from pathlib import Path

import pytest

from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.replay.replayer import open_view
from branch_settlement.projections import keys
from branch_settlement.projections.store import NO_OFFSET, MemoryStore, RocksStore
from branch_settlement.schemas.codec import default_codec
from tests.harness import Ledger, T0

pytestmark = pytest.mark.unit


@pytest.fixture(params=["memory", "rocksdb"])
def make_store(request, tmp_path: Path):
    """A factory: calling it again reopens the same store (a restart)."""
    opened = []
    shared = MemoryStore()

    def make():
        for store in opened:
            if request.param == "rocksdb":
                store.close()
        opened.clear()
        store = shared if request.param == "memory" else RocksStore(tmp_path / "db")
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def test_empty_store_has_no_offset_and_no_keys(make_store) -> None:
    store = make_store()
    assert store.changelog_offset() == NO_OFFSET
    assert store.get(b"p\x00x") is None
    assert list(store.scan(b"p\x00")) == []


def test_write_puts_deletes_and_offset_together(make_store) -> None:
    store = make_store()
    store.write([(b"p\x00a", b"1"), (b"p\x00b", b"2"), (b"c\x00a", b"3")], 7)
    store.write([(b"p\x00a", None), (b"p\x00b", b"22")], 9)
    assert store.get(b"p\x00a") is None
    assert store.get(b"p\x00b") == b"22"
    assert store.changelog_offset() == 9
    reopened = make_store()
    assert reopened.get(b"p\x00b") == b"22" and reopened.changelog_offset() == 9


def test_scan_is_ordered_and_bounded_by_the_prefix(make_store) -> None:
    store = make_store()
    timers = [keys.timer_key(d, "child_lease", "P", "c") for d in (30, 5, 1000, 7)]
    store.write([(k, b"") for k in timers] + [(b"u\x00after", b""), (b"s\x00before", b"")], 0)
    scanned = [k for k, _ in store.scan(keys.prefix(keys.TIMER))]
    assert scanned == sorted(timers)
    assert [int(k.split(b"\x00")[1]) for k in scanned] == [5, 7, 30, 1000]


def test_delete_of_a_missing_key_is_harmless(make_store) -> None:
    store = make_store()
    store.write([(b"p\x00nothing", None)], 1)
    assert store.get(b"p\x00nothing") is None and store.changelog_offset() == 1


def test_view_discard_returns_to_the_committed_ledger(make_store) -> None:
    store = make_store()
    L = Ledger(store)
    L.tick(T0)
    L.open_parent()
    L.reserve("A")
    L.activate("A")
    L.checkpoint()
    L.send("ChildCompleted", child_id="A", attempt_id="A1", lease_generation=1, usage={"tokens": 5})
    assert L.balance()["available"] == 95
    L.view.discard()
    assert L.balance()["available"] == 80
    assert L.state("A") == "activated"


def test_a_restarted_view_fires_the_timers_it_committed(make_store) -> None:
    store = make_store()
    L = Ledger(store)
    L.tick(T0)
    L.open_parent()
    L.reserve("A")
    L.activate("A")
    L.checkpoint()
    codec = default_codec()
    view = open_view(make_store(), codec)
    assert view.pending_timer_count() == 2  # the parent's lease and the child's
    out = Outputs()
    Fold(view).apply(codec.event_from_json({"type": "Tick", "event_id": "t", "idempotency_key": "tick/0/x",
                                            "parent_id": "", "occurred_at_ms": 0, "now_ms": T0 + 61_000}), 99, out)
    assert view.child("P", "A")["state"] == "reconciling"
