"""One owned input partition: its projection, its fold, and what it produced since the last checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from processors.fold import Fold
from processors.outputs import Outputs
from projections import keys
from projections.store import RocksStore
from projections.view import LedgerView
from schemas.codec import Codec


def store_path(state_dir: str, group_id: str, partition: int) -> Path:
    return Path(state_dir) / group_id / f"partition-{partition}"


class PartitionTask:
    def __init__(self, partition: int, store: RocksStore, codec: Codec, committed_position: int) -> None:
        self.partition = partition
        self.store = store
        self.codec = codec
        self.view = LedgerView(store, codec.encode, codec.decode)
        self.fold = Fold(self.view, partition)
        self.out = Outputs()
        self.dead_letters: list[tuple[bytes | None, dict]] = []
        # Next input offset to commit once the buffered work is committed; None: nothing folded since.
        self.position: int | None = None
        # Next input offset the group has committed: where to rewind after an abort.
        self.committed_position = committed_position
        self.stopped: str | None = None  # why, when an invariant violation stopped the partition
        self.last_tick_ms = 0
        self.capacity = self._capacity_from_store()

    def has_work(self) -> bool:
        return self.position is not None or bool(self.dead_letters)

    def discard(self) -> None:
        """Forget everything since the last commit (after an abort): the projection is as committed."""
        self.view.discard()
        self.out.clear()
        self.dead_letters.clear()
        self.position = None

    def committed(self, changes: list, changelog_offset: int | None) -> None:
        """The transaction committed: write the projection batch, then forget the buffers."""
        if changes:
            self._update_capacity(changes)
            self.store.write(changes, changelog_offset)
        self.view.mark_committed()
        self.out.clear()
        self.dead_letters.clear()
        if self.position is not None:
            self.committed_position = self.position
        self.position = None

    def close(self) -> None:
        self.store.close()

    # -- capacity totals for the metrics: summed over this partition's parents ---------------------------

    def _capacity_from_store(self) -> dict[tuple[str, str], int]:
        totals: dict[tuple[str, str], int] = {}
        for _, raw in self.store.scan(keys.prefix(keys.PARENT)):
            self._add(totals, self.codec.decode(raw)[1], 1)
        return totals

    @staticmethod
    def _add(totals: dict, parent: dict, sign: int) -> None:
        for dim, balance in parent["dimensions"].items():
            for term, value in balance.items():
                if term != "kind":
                    totals[(term, dim)] = totals.get((term, dim), 0) + sign * value

    def _update_capacity(self, changes: list) -> None:
        prefix = keys.prefix(keys.PARENT)
        for key, value in changes:
            if not key.startswith(prefix):
                continue
            old = self.store.get(key)
            if old is not None:
                self._add(self.capacity, self.codec.decode(old)[1], -1)
            if value is not None:
                self._add(self.capacity, self.codec.decode(value)[1], 1)


def open_store(state_dir: str, group_id: str, partition: int) -> RocksStore:
    path = store_path(state_dir, group_id, partition)
    os.makedirs(path.parent, exist_ok=True)
    return RocksStore(path)
