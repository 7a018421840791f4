"""Progress of a consumer group through a backlog, from the offsets it has committed (the processor and the
pass-through both commit them in their transactions, so one poller measures both the same way)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition

POLL_INTERVAL_S = 0.1


@dataclass(frozen=True)
class Throughput:
    records: int
    seconds: float  # from the release of the backlog until every offset was committed
    events_per_s: float  # records / seconds
    steady_events_per_s: float  # between 10% and 90% committed: without the first and the last checkpoints

    def as_dict(self) -> dict:
        return {"records": self.records, "seconds": round(self.seconds, 3),
                "events_per_s": round(self.events_per_s), "steady_events_per_s": round(self.steady_events_per_s)}


class CommittedPoller(threading.Thread):
    def __init__(self, client_config: dict, group: str, topic: str, targets: dict[int, int]) -> None:
        super().__init__(daemon=True)
        self.consumer = Consumer({**client_config, "group.id": group, "enable.auto.commit": False,
                                  "isolation.level": "read_uncommitted"})
        self.partitions = [TopicPartition(topic, p) for p in sorted(targets)]
        self.total = sum(targets.values())
        self.samples: list[tuple[float, int]] = []
        self.finished = threading.Event()
        self.stop_flag = threading.Event()

    def committed(self) -> int:
        found = self.consumer.committed(self.partitions, timeout=10)
        return sum(max(tp.offset, 0) for tp in found)

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                try:
                    done = self.committed()
                except KafkaException:
                    time.sleep(POLL_INTERVAL_S)
                    continue
                self.samples.append((time.monotonic(), done))
                if done >= self.total:
                    self.finished.set()
                    return
                time.sleep(POLL_INTERVAL_S)
        finally:
            self.consumer.close()

    def wait(self, timeout_s: float, alive=lambda: None) -> None:
        """Until every offset is committed; `alive()` may raise to end the wait early (a dead process)."""
        deadline = time.monotonic() + timeout_s
        while not self.finished.wait(0.5):
            alive()
            if time.monotonic() > deadline:
                self.stop_flag.set()
                last = self.samples[-1][1] if self.samples else 0
                raise RuntimeError(f"only {last} of {self.total} offsets committed in {timeout_s} s")

    def throughput(self, released_at: float) -> Throughput:
        end = self.samples[-1][0]
        seconds = end - released_at
        return Throughput(self.total, seconds, self.total / seconds, self._steady())

    def _steady(self) -> float:
        return rate_between(self.samples, self.total, 0.1, 0.9)


def rate_between(samples: list[tuple[float, int]], total: int, low: float, high: float) -> float:
    """Records per second between the moments `low` and `high` (fractions of `total`) were committed."""
    lo, hi = low * total, high * total
    t_low, t_high = _crossing(samples, lo), _crossing(samples, hi)
    return (hi - lo) / (t_high - t_low) if t_high > t_low else 0.0


def _crossing(samples: list[tuple[float, int]], level: float) -> float:
    """When the committed count crossed `level`, interpolated between two polls."""
    previous = (samples[0][0], 0)
    for t, n in samples:
        if n >= level:
            t0, n0 = previous
            return t0 + (t - t0) * ((level - n0) / (n - n0)) if n > n0 else t
        previous = (t, n)
    return samples[-1][0]
