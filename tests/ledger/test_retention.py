"""Retention by ledger time (decision 22): a parent closed more than `CLOSED_PARENT_RETENTION_MS` of ledger time
ago is compacted when a tick passes closed_at + retention: its children, idempotency records and timers are
deleted, the parent record becomes a tombstone that still says `closed`, and late events get `parent_closed`
with nothing changed or released. Checked with the ledger auditor on every event (tests/harness.py), and
through the store: deletes reach the checkpoint's changes as (key, None), a restore of those changes gives the
same projection, and a replay of the same events gives the same outputs and ledger."""

from __future__ import annotations

import pytest

from branch_settlement.projections import keys, model
from branch_settlement.projections.store import MemoryStore
from tests.harness import PARENT, T0, Ledger
from tests.ledger.test_transitions import activated, complete

pytestmark = pytest.mark.unit

DAY_MS = 24 * 3600 * 1000
RETENTION_MS = model.CLOSED_PARENT_RETENTION_MS


def closed_parent(L: Ledger) -> int:
    """A parent with two settled children (one committed, one skipped), closed; returns its closing time."""
    L.tick(T0)
    activated(L)
    L.reserve("B", tokens=10)
    assert L.send("ChildSkipped", child_id="B", attempt_id="B1", reason="not needed") == "ok"
    assert L.send("ParentClosed", key="P/close", outcome="succeeded") == "ok"
    assert complete(L, 12) == "ok"
    assert L.status() == "closed"
    return L.view.meta["ledger_time_ms"]


def store_keys(store: MemoryStore, kind: bytes, parent_id: str = PARENT) -> list[bytes]:
    return [key for key, _ in store.scan(keys.prefix(kind)) if parent_id.encode() in key.split(keys.SEP)]


def parent_timers(L: Ledger, parent_id: str = PARENT) -> list:
    return [timer for timer in L.view._timers if timer[2] == parent_id]


def test_the_default_retention_is_seven_days_of_ledger_time() -> None:
    assert RETENTION_MS == 7 * DAY_MS


def test_a_closed_parent_is_kept_whole_until_its_retention_ends() -> None:
    L = Ledger()
    closed_at = closed_parent(L)
    parent = L.view.parent(PARENT)
    assert parent["closed_at_ms"] == closed_at and parent["compacted_at_ms"] is None
    L.tick(closed_at + RETENTION_MS - 1)
    assert L.child("A")["state"] == "released"  # completed with a remainder
    assert L.send("ParentClosed", key="P/close", outcome="succeeded") == "duplicate"  # idempotency kept
    assert L.send("ParentClosed", key="P/close", outcome="failed") == "idempotency_conflict"
    assert not any("compacted" in a["note"] for a in L.out.audits)


def test_a_tick_past_the_retention_compacts_the_parent_to_a_tombstone() -> None:
    L = Ledger()
    closed_at = closed_parent(L)
    L.checkpoint()
    assert store_keys(L.store, keys.CHILD) and store_keys(L.store, keys.IDEMPOTENCY)
    before_releases = len(L.out.releases)
    assert L.tick(closed_at + RETENTION_MS) == "ok"
    parent = L.view.parent(PARENT)
    assert parent["status"] == "closed" and parent["outcome"] == "succeeded"
    assert parent["compacted_at_ms"] == closed_at + RETENTION_MS
    assert (parent["children"], parent["dimensions"], parent["winners"], parent["loans"]) == ([], {}, {}, [])
    assert L.child("A") is None and L.child("B") is None
    assert parent_timers(L) == []
    assert len(L.out.releases) == before_releases  # nothing released
    [audit] = [a for a in L.out.audits if "compacted" in a["note"]]
    assert (audit["prior_state"], audit["new_state"], audit["event_type"]) == ("closed", "closed", "Tick")
    assert "deleted 2 children" in audit["note"] and "idempotency records" in audit["note"]
    changes = dict(L.view.changes())
    deleted = {key for key, value in changes.items() if value is None}
    assert {keys.child_key(PARENT, "A"), keys.child_key(PARENT, "B")} <= deleted
    assert set(store_keys(L.store, keys.IDEMPOTENCY)) <= deleted
    L.checkpoint()
    assert store_keys(L.store, keys.CHILD) == [] and store_keys(L.store, keys.IDEMPOTENCY) == []
    assert [k for k, _ in L.store.scan(keys.prefix(keys.TIMER)) if PARENT.encode() in k] == []
    assert L.store.get(keys.parent_key(PARENT)) is not None  # the tombstone stays


def test_late_events_for_a_compacted_parent_are_parent_closed_and_change_nothing() -> None:
    L = Ledger()
    closed_at = closed_parent(L)
    L.tick(closed_at + RETENTION_MS)
    L.checkpoint()
    before = dict(L.store.scan(b""))
    releases = len(L.out.releases)
    late = [
        L.send("ParentClosed", key="P/close", outcome="succeeded"),  # a redelivery: no longer told `duplicate`
        L.send("ParentClosed", key="P/close", outcome="failed"),
        complete(L, 12),
        L.reserve("C"),
        L.activate("A"),
        L.send("UsageAdjustment", child_id="A", attempt_id="A1", usage={"tokens": 1}),
        L.lend("L1"),
        L.return_loan("L1", tokens=0),
        # a ParentReserved reusing the id opens no fresh ledger
        L.open_parent(),
    ]
    assert late == ["parent_closed"] * len(late)
    detail = L.out.results[-1]["detail"]
    assert "compacted" in detail and "cannot be told" in detail
    assert len(L.out.releases) == releases and not L.out.revocations[releases:]
    assert L.view.changes() == []
    assert dict(L.store.scan(b"")) == before


def test_a_parent_that_is_not_closed_is_never_compacted() -> None:
    L = Ledger()
    L.tick(T0)
    L.open_parent(lease_ttl_ms=100 * DAY_MS)
    L.reserve("A")
    L.activate("A", lease_ttl_ms=100 * DAY_MS)
    L.send("ParentClosed", outcome="succeeded")  # closing: a child is live
    L.open_parent(parent_id="Q", lease_ttl_ms=100 * DAY_MS)
    L.tick(T0 + 3 * RETENTION_MS)
    assert L.status() == "closing" and L.child("A") is not None
    assert L.status("Q") == "open" and L.view.parent("Q")["compacted_at_ms"] is None


def test_a_stranded_child_keeps_the_parent_open_and_uncompacted() -> None:
    L = Ledger()
    L.tick(T0)
    activated(L)
    L.send("ParentClosed", outcome="failed")
    L.tick(T0 + 61_000)
    L.tick(T0 + 61_000 + 600_000)
    assert L.state("A") == "stranded"
    L.tick(T0 + 2 * RETENTION_MS)
    assert L.status() == "closing" and L.state("A") == "stranded"
    resolved_at = T0 + 2 * RETENTION_MS
    assert L.send("ReconciliationResolved", child_id="A", attempt_id="A1", usage={"tokens": 9},
                  resolution="operator") == "ok"
    assert L.status() == "closed" and L.view.parent(PARENT)["closed_at_ms"] == resolved_at
    L.tick(resolved_at + RETENTION_MS - 1)
    assert L.child("A") is not None
    L.tick(resolved_at + RETENTION_MS)
    assert L.child("A") is None and model.is_compacted(L.view.parent(PARENT))


def test_an_open_loan_keeps_the_parent_uncompacted() -> None:
    L = Ledger()
    L.tick(T0)
    L.open_parent(lending_limit={"tokens": 50})
    assert L.lend("L1", tokens=30) == "ok"
    L.send("ParentClosed", outcome="succeeded")
    L.tick(T0 + 2 * RETENTION_MS)
    assert L.status() == "closing" and L.loan("L1")["state"] == "open"
    assert L.return_loan("L1", tokens=5) == "ok"
    assert L.status() == "closed"
    L.tick(T0 + 3 * RETENTION_MS)
    assert model.is_compacted(L.view.parent(PARENT))
    assert L.return_loan("L1", tokens=5) == "parent_closed"  # its return's record is gone too


def test_the_timers_of_a_compacted_parent_are_deleted() -> None:
    """A closed parent whose lease would end after its retention, and a child lease renewed past it: the
    compaction deletes them (heap and store), so the heap holds only what can still fire."""
    L = Ledger()
    L.tick(T0)
    L.open_parent(lease_ttl_ms=30 * DAY_MS)
    L.reserve("A")
    L.activate("A", lease_ttl_ms=20 * DAY_MS)
    assert L.send("LeaseRenewed", child_id="A", attempt_id="A1", lease_generation=1,
                  lease_ttl_ms=21 * DAY_MS) == "ok"
    L.send("ParentClosed", outcome="succeeded")
    assert complete(L, 3) == "ok"
    L.checkpoint()
    kinds = sorted(timer[1] for timer in parent_timers(L))
    assert kinds == ["child_lease", "child_lease", "parent_lease", "parent_retention"]
    L.tick(T0 + RETENTION_MS + 1)
    assert parent_timers(L) == []
    L.checkpoint()
    assert [k for k, _ in L.store.scan(keys.prefix(keys.TIMER))] == []
    assert L.view.pending_timer_count() == 0


def test_a_parent_closed_before_the_first_tick_keeps_its_retention_from_that_tick() -> None:
    L = Ledger()
    L.open_parent()
    L.reserve("A")
    L.send("ChildSkipped", child_id="A", attempt_id="A1", reason="no")
    L.send("ParentClosed", outcome="succeeded")
    assert L.status() == "closed" and L.view.parent(PARENT)["closed_at_ms"] == 0
    L.tick(T0)  # the first tick: ledger time 0 was no time; the retention starts now
    assert not model.is_compacted(L.view.parent(PARENT))
    assert L.view.parent(PARENT)["closed_at_ms"] == T0
    L.tick(T0 + RETENTION_MS - 1)
    assert not model.is_compacted(L.view.parent(PARENT))
    L.tick(T0 + RETENTION_MS)
    assert model.is_compacted(L.view.parent(PARENT))


def test_compaction_spares_other_parents_with_a_common_id_prefix() -> None:
    L = Ledger()
    closed_at = closed_parent(L)
    L.open_parent(parent_id="PP", lease_ttl_ms=100 * DAY_MS)
    L.send("ChildReserved", parent_id="PP", child_id="A", branch_id="A", attempt_id="A1",
           quantities={"tokens": 1})
    L.checkpoint()
    L.tick(closed_at + RETENTION_MS)
    assert L.view.child("PP", "A") is not None
    assert L.view.idempotency("PP", L.out.results[-2]["idempotency_key"]) is not None


def test_compaction_is_the_same_whatever_the_checkpoints() -> None:
    """Twice the same events, one ledger checkpointing between events, the other only at the end: the same
    results, audits, releases and summaries, and stores that hold the same records."""
    def run(every: bool) -> tuple[Ledger, list]:
        L = Ledger()
        closed_at = closed_parent(L)
        for step in (lambda: L.open_parent(parent_id="Q", lease_ttl_ms=DAY_MS),
                     lambda: L.tick(closed_at + 2 * DAY_MS),  # Q expires
                     lambda: L.tick(closed_at + RETENTION_MS),
                     lambda: L.tick(closed_at + 2 * DAY_MS + RETENTION_MS)):
            if every:
                L.checkpoint()
            step()
        L.checkpoint()
        outputs = [L.out.results, L.out.audits, L.out.releases, L.out.settled]
        return L, [[{k: v for k, v in record.items() if k != "input_offset"} for record in records]
                   for records in outputs]  # a checkpoint takes an offset of the harness

    a, out_a = run(True)
    b, out_b = run(False)
    assert out_a == out_b
    offset = {keys.CHANGELOG_OFFSET_KEY: b""}
    assert dict(a.store.scan(b"")) | offset == dict(b.store.scan(b"")) | offset
    assert model.is_compacted(a.view.parent("Q")) and model.is_compacted(a.view.parent(PARENT))


def test_a_restore_from_the_compacted_changelog_gives_the_same_projection() -> None:
    """The checkpoints' changes are the changelog's records (a delete is a null-value record): once the topic
    is compacted (the latest record of each key, deletes dropped), writing what remains into an empty store
    gives the projection, and a view on it holds the same timers."""
    L = Ledger()
    changelog: list[tuple[bytes, bytes | None]] = []

    def checkpoint() -> None:
        changelog.extend(L.view.changes())
        L.checkpoint()

    closed_at = closed_parent(L)
    checkpoint()
    L.open_parent(parent_id="Q", lease_ttl_ms=100 * DAY_MS)
    L.send("ChildReserved", parent_id="Q", child_id="A", branch_id="A", attempt_id="A1", quantities={"tokens": 1})
    checkpoint()
    L.tick(closed_at + RETENTION_MS)
    checkpoint()
    latest: dict[bytes, bytes | None] = {}
    for key, value in changelog:
        latest.pop(key, None)
        latest[key] = value
    compacted = [(key, value) for key, value in latest.items() if value is not None]
    assert any(value is None for value in latest.values())  # the compaction's tombstones
    restored = Ledger(MemoryStore())
    restored.store.write(compacted, 0)
    offset = {keys.CHANGELOG_OFFSET_KEY: b""}
    assert dict(restored.store.scan(b"")) | offset == dict(L.store.scan(b"")) | offset
    again = Ledger(restored.store)
    assert sorted(again.view._timers) == sorted(L.view._timers)
    assert model.is_compacted(again.view.parent(PARENT)) and again.view.child("Q", "A") is not None
