"""CPU time of running processes, sampled: what a processor or the pass-through spent between the release of
the backlog and its last commit, in microseconds per input record. A figure the machine's load moves less than
a rate (docs/benchmarks.md), reported next to each rate."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


class CpuSampler(threading.Thread):
    """CPU seconds (user + system, every thread) of `children` (objects with a `pid`), summed, every 20 ms."""

    def __init__(self, children) -> None:
        super().__init__(daemon=True)
        self.children, self.samples, self.done = list(children), [], threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.done.wait(0.02):
            total = 0.0
            for child in self.children:
                try:
                    fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                total += (int(fields[11]) + int(fields[12])) / self.tick
            self.samples.append((time.monotonic(), total))

    def stop(self) -> None:
        self.done.set()
        self.join()

    def between(self, start: float, end: float) -> float:
        """CPU seconds spent between two monotonic times (the samples at or before each)."""
        def at(t: float) -> float:
            before = [cpu for ts, cpu in self.samples if ts <= t]
            return before[-1] if before else 0.0
        return at(end) - at(start)

    def us_per_record(self, progress: list[tuple[float, int]], seconds: float, records: int) -> float | None:
        """CPU µs per record over the run that `progress` (the committed-offsets poller's samples) ended and
        that took `seconds`; None without samples."""
        if not progress or not records or not self.samples:
            return None
        end = progress[-1][0]
        return round(self.between(end - seconds, end) * 1e6 / records, 1)
