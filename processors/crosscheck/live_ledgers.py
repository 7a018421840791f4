"""The live projections' ledgers, read-only, for comparison with a replay."""

from __future__ import annotations

from dataclasses import dataclass

from branch_settlement.processors.kafka.partition import store_path, stored_partitions
from branch_settlement.processors.replay.replayer import ledger_snapshot
from branch_settlement.projections.store import RocksStore, Store
from branch_settlement.schemas.codec import default_codec


@dataclass
class LiveProjections:
    """The live projections of a processor's state directory (kafka/partition.py's layout), opened
    read-only by whichever process replays partition N."""

    state_dir: str
    group_id: str

    def open(self, partition: int) -> Store | None:
        path = store_path(self.state_dir, self.group_id, partition)
        return RocksStore(path, read_only=True) if path.exists() else None


def live_projections(state_dir: str, group_id: str) -> LiveProjections:
    """The processor's projections, for `audit_replay(live_ledgers=...)`: each replay process opens the
    partitions it replays (read-only) and compares record bytes before decoding any."""
    stored_partitions(state_dir, group_id)  # fails at once when there are none
    return LiveProjections(state_dir, group_id)


def live_ledgers(state_dir: str, group_id: str, partitions: list[int]) -> dict[int, dict]:
    stored = stored_partitions(state_dir, group_id)
    codec = default_codec()
    ledgers = {}
    for partition in partitions:
        path = stored.get(partition)
        if path is None:
            continue
        store = RocksStore(path, read_only=True)
        try:
            ledgers[partition] = ledger_snapshot(store, codec)
        finally:
            store.close()
    return ledgers
