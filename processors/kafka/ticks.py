"""The processor's own Tick events: ledger time for the partitions it owns (SPEC §7).

A tick is not folded when it is made: it is appended to the input partition by the next checkpoint's
transaction, and folded when the consumer reads it back, like any input. So a replay of the input topic sees
the same ticks at the same places as the processor did.
"""

from __future__ import annotations

from typing import Callable, Iterable

from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.schemas.codec import Codec

Ticks = list[tuple[int, bytes]]  # (partition, encoded Tick), in the order they were made


def schedule_ticks(ticks: Ticks, tasks: Iterable[PartitionTask], interval_ms: int, clock: Callable[[], float],
                   codec: Codec) -> None:
    """Append a tick for each running partition whose last one is `interval_ms` old; 0 makes none."""
    if not interval_ms:
        return
    now_ms = int(clock() * 1000)
    for task in tasks:
        if task.stopped or now_ms - task.last_tick_ms < interval_ms:
            continue
        task.last_tick_ms = now_ms
        ticks.append((task.partition, codec.encode_event(tick_event(task.partition, now_ms))))


def tick_event(partition: int, now_ms: int) -> dict:
    return {"type": "Tick", "event_id": f"tick-{partition}-{now_ms}",
            "idempotency_key": f"tick/{partition}/{now_ms}", "parent_id": "",
            "occurred_at_ms": now_ms, "now_ms": now_ms}


def ticks_of(ticks: Ticks, partitions) -> Ticks:
    """The ticks of `partitions` (a container of partition numbers)."""
    return [(p, tick) for p, tick in ticks if p in partitions]


def ticks_except(ticks: Ticks, partitions) -> Ticks:
    """The ticks of every partition but `partitions` (a container of partition numbers)."""
    return [(p, tick) for p, tick in ticks if p not in partitions]
