"""The live projections' ledgers, read-only, for comparison with a replay."""

from __future__ import annotations

from pathlib import Path

from branch_settlement.errors import SettlementError
from branch_settlement.processors.replay.replayer import ledger_snapshot
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas.codec import default_codec


def live_projections(state_dir: str, group_id: str):
    """The processor's projections, for `audit_replay(live_ledgers=...)`: each replay process opens the
    partitions it replays (read-only) and compares record bytes before decoding any."""
    from branch_settlement.processors.crosscheck.topic_replay import LiveProjections

    return LiveProjections(str(_root(state_dir, group_id)))


def _root(state_dir: str, group_id: str) -> Path:
    root = Path(state_dir) / group_id
    if not root.is_dir():
        raise SettlementError(f"no projections under {root}: is --state-dir/--group-id the processor's?")
    return root


def live_ledgers(state_dir: str, group_id: str, partitions: list[int]) -> dict[int, dict]:
    root = _root(state_dir, group_id)
    codec = default_codec()
    ledgers = {}
    for partition in partitions:
        path = root / f"partition-{partition}"
        if not path.exists():
            continue
        store = RocksStore(path, read_only=True)
        try:
            ledgers[partition] = ledger_snapshot(store, codec)
        finally:
            store.close()
    return ledgers
