"""I8 of the independent verifier (faults/verify.py check_ticks) on records made here: a tick committed on
ledger-ticks without its result on settlement-results is named by its ledger-ticks offset, so that a failed
scenario points at the batch to read with kafka-dump-log."""

from __future__ import annotations

import pytest

from branch_settlement.processors.kafka.ticks import anchor_key, tick_event
from branch_settlement.schemas.codec import default_codec
from faults.verify import check_ticks

pytestmark = pytest.mark.unit


def _ticks(partition: int, anchors: list[int]) -> list[tuple[int, bytes, bytes]]:
    codec = default_codec()
    return [(n, anchor_key(anchor), codec.encode_event(tick_event(partition, 1_000 * (n + 1))))
            for n, anchor in enumerate(anchors)]


def _result(tick: dict, anchor: int) -> dict:
    return {"event_id": tick["event_id"], "idempotency_key": tick["idempotency_key"], "event_type": "Tick",
            "result": "ok", "input_offset": anchor}


def test_every_tick_with_its_result_passes_and_a_tick_without_one_is_named_by_its_offset() -> None:
    codec = default_codec()
    ticks = {0: _ticks(0, [0, 3, 3, 7])}
    results = {0: [(n, None, _result(codec.decode_event(value), int(key))) for n, (_, key, value)
                   in enumerate(ticks[0])]}
    assert check_ticks(ticks, results, {0: 9}) == {"ok": True, "ticks_committed": 4, "problems": []}

    del results[0][2]  # the result of the tick at ledger-ticks offset 2
    checked = check_ticks(ticks, results, {0: 9})
    assert not checked["ok"]
    assert checked["problems"] == ["partition 0: 4 ticks on ledger-ticks, 3 tick results on settlement-results "
                                   "(1 without a result, 0 without a tick); without a result: ledger-ticks offsets "
                                   "[2]"]
