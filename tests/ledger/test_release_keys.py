"""Release keys are unique whatever the ids (processors/ledger/context.py release_key): a consumer that
deduplicates releases by key must never drop a release because another had the same key."""

from __future__ import annotations

import pytest

from branch_settlement.processors.ledger.context import release_key
from tests.harness import T0, Ledger

pytestmark = pytest.mark.unit


def test_a_child_named_dash_does_not_share_its_parents_key() -> None:
    """A child called '-' was keyed like the parent's own release: on close, the parent's 80 and the child's
    20 had one key, and a deduplicating consumer dropped one of them."""
    L = Ledger()
    L.tick(T0)
    L.open_parent(tokens=100)
    assert L.reserve("-", tokens=20) == "ok"
    assert L.send("ParentClosed", outcome="cancelled") == "ok"
    keys = [r["release_key"] for r in L.out.releases]
    assert sorted((r["child_id"], r["quantity"]) for r in L.out.releases) == [("", 80), ("-", 20)]
    assert len(set(keys)) == len(keys) == 2


def test_slashes_in_ids_cannot_make_two_keys_alike() -> None:
    a = release_key("P", "P/k/1", "a/b", "c", "parent")
    b = release_key("P", "P/k/1", "a", "b/c", "parent")
    c = release_key("P/P", "k/1", "a", "b", "parent")
    d = release_key("P", "P/k/1", "a%2Fb", "c", "parent")
    assert len({a, b, c, d}) == 4


def test_ids_of_the_usual_kind_keep_their_keys() -> None:
    assert release_key("wf-42", "wf-42/B/B1/1", "B", "tokens", "parent") == "wf-42/wf-42/B/B1/1/B/tokens/parent"
    assert release_key("wf-42", "wf-42/ParentClosed/1", "", "tokens", "global_pool") == \
        "wf-42/wf-42/ParentClosed/1/-/tokens/global_pool"
