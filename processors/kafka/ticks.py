"""The processor's own Tick events: ledger time for the partitions it owns (SPEC §7).

Only the processor advances ledger time. A tick is made from the processor's clock (the system clock, or a
file that a simulation or a demo writes: `settle run --clock-file`), folded at once at the partition's
input position, and written to `ledger-ticks` in the same transaction as its outputs and the input offsets,
keyed by that position: the input offset it applies before. So the tick, its effects and the position commit
or abort together; a replay merges `ledger-ticks` back into the input at those offsets
(processors/replay/replayer.py, merge_ticks) and re-derives every expiry. A Tick that a producer writes to
the input topic is answered `tick_not_accepted` and changes nothing, so no producer principal can forge time,
and the processor needs no WRITE on its input.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from branch_settlement.processors.kafka.partition import PartitionTask

log = logging.getLogger("settle.processor")

TICKS_TOPIC = "ledger-ticks"


def tick_event(partition: int, now_ms: int) -> dict:
    return {"type": "Tick", "event_id": f"tick-{partition}-{now_ms}",
            "idempotency_key": f"tick/{partition}/{now_ms}", "parent_id": "",
            "occurred_at_ms": now_ms, "now_ms": now_ms}


def anchor_key(anchor: int) -> bytes:
    """A ledger-ticks record's key: the input offset its tick applies before, in decimal."""
    return b"%d" % anchor


def anchor_of(key: bytes | None) -> int | None:
    """The anchor in a ledger-ticks record's key; None when the key is not one."""
    if key is None or not key.isdigit() or len(key) > 19:
        return None
    return int(key)


def schedule_ticks(tasks: Iterable["PartitionTask"], interval_ms: int, clock: Callable[[], float],
                   fold: Callable[["PartitionTask", dict], object] = lambda task, tick: task.fold_tick(tick)) -> int:
    """Fold a tick (with `fold`) into each running partition whose last one is `interval_ms` old by `clock`
    (seconds); 0 makes none. Returns how many were made."""
    if not interval_ms:
        return 0
    now_ms = int(clock() * 1000)
    made = 0
    for task in tasks:
        if task.stopped or now_ms - task.last_tick_ms < interval_ms:
            continue
        task.last_tick_ms = now_ms
        fold(task, tick_event(task.partition, now_ms))
        made += 1
    return made


class FileClock:
    """A clock read from a file holding a time in milliseconds since the epoch (a simulation's or a demo's
    ledger time): the processor ticks when the time in the file has moved `interval_ms` past its last tick.
    The file is the processor operator's, like the system clock: whoever can write it sets ledger time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._now = 0.0

    def __call__(self) -> float:
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            if self._stamp is not None:
                log.warning("clock file %s: %s; keeping %d", self.path, exc.strerror, int(self._now * 1000))
            return self._now
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                with open(self.path) as f:
                    text = f.read().strip()
            except OSError:
                return self._now
            if text.isdigit():
                self._now = max(self._now, int(text) / 1000)
            else:
                log.warning("clock file %s: %r is not a time in milliseconds; keeping %d", self.path, text[:40],
                            int(self._now * 1000))
        return self._now
