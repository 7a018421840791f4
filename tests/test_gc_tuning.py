"""The collector policy of processors/gc_tuning.py: survivors of a checkpoint are frozen out of the cyclic
collector's sight, and a cycle frozen with them is still reclaimed by the periodic full collection; between
checkpoints the young generation is collected rarely, and a cycle that became garbage since the last checkpoint is
reclaimed at the next one."""

from __future__ import annotations

import gc
import weakref

import pytest

from branch_settlement.processors import gc_tuning

pytestmark = pytest.mark.unit


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def policy(monkeypatch):
    monkeypatch.setattr(gc_tuning, "enabled", True)
    monkeypatch.setattr(gc_tuning, "FULL_COLLECTION_CHECKPOINTS", 5)
    threshold = gc.get_threshold()
    gc_tuning.full_collection()
    yield gc_tuning
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_a_cycle_frozen_at_a_checkpoint_lives_until_the_full_collection(policy) -> None:
    node = Node()
    alive = weakref.ref(node)
    policy.after_checkpoint()  # still in use: frozen with the other survivors
    del node
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert alive() is not None  # frozen: out of the collector's sight
    for _ in range(3):
        policy.after_checkpoint()
    assert alive() is not None
    policy.after_checkpoint()  # the 5th checkpoint since the last full collection
    assert alive() is None


def test_a_cycle_that_became_garbage_since_the_last_checkpoint_is_reclaimed_at_the_next(policy) -> None:
    policy.after_checkpoint()
    assert gc.get_threshold()[0] == gc_tuning.YOUNG_THRESHOLD  # no young collection every 700 objects
    node = Node()
    alive = weakref.ref(node)
    del node
    assert alive() is not None  # garbage, not collected yet
    policy.after_checkpoint()  # the first since the full collection: no full collection
    assert alive() is None


def test_off_freezes_nothing(policy, monkeypatch) -> None:
    monkeypatch.setattr(gc_tuning, "enabled", False)
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    policy.after_checkpoint()
    assert gc.get_threshold()[0] == 700  # CPython's, untouched
    node = Node()
    alive = weakref.ref(node)
    del node
    policy.after_checkpoint()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
