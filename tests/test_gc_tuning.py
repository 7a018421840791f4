"""The collector policy of processors/gc_tuning.py: survivors of a checkpoint are frozen out of the cyclic
collector's sight, and a cycle frozen with them is still reclaimed by the periodic full collection."""

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
    gc_tuning.full_collection()
    yield gc_tuning
    gc.unfreeze()


def test_a_cycle_frozen_at_a_checkpoint_lives_until_the_full_collection(policy) -> None:
    node = Node()
    alive = weakref.ref(node)
    del node
    policy.after_checkpoint()
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert alive() is not None  # frozen: out of the collector's sight
    for _ in range(3):
        policy.after_checkpoint()
    assert alive() is not None
    policy.after_checkpoint()  # the 5th checkpoint since the last full collection
    assert alive() is None


def test_off_freezes_nothing(policy, monkeypatch) -> None:
    monkeypatch.setattr(gc_tuning, "enabled", False)
    gc.unfreeze()
    node = Node()
    alive = weakref.ref(node)
    del node
    policy.after_checkpoint()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
