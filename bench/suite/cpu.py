"""CPU time of running processes, sampled: what a processor or the pass-through spent between the release of
the backlog and its last commit, in microseconds per input record. A figure the machine's load moves less than
a rate (docs/benchmarks.md), reported next to each rate."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _cpu_seconds(stat_path: str, tick: int) -> float | None:
    """user + system CPU seconds from a /proc/.../stat file; None once the process is gone."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / tick


def _machine_jiffies() -> tuple[int, int]:
    """(idle, total) clock ticks of every core since boot (/proc/stat: idle and iowait count as idle)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def _last_at(samples: list[tuple], t: float) -> tuple | None:
    """The last of `samples` (in time order, each starting with its monotonic time) taken at or before `t`."""
    before = [sample for sample in samples if sample[0] <= t]
    return before[-1] if before else None


class CpuSampler(threading.Thread):
    """CPU seconds (user + system, every thread) of `children` (objects with a `pid`), summed, every 20 ms; with
    them the main threads' CPU seconds (summed) and the machine's idle and total clock ticks."""

    def __init__(self, children) -> None:
        super().__init__(daemon=True)
        self.children, self.samples, self.done = list(children), [], threading.Event()
        self.main: list[tuple[float, float]] = []  # (monotonic time, the main threads' CPU seconds)
        self.machine: list[tuple[float, int, int]] = []  # (monotonic time, idle ticks, total ticks)
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.done.wait(0.02):
            total = main = 0.0
            for child in self.children:
                total += _cpu_seconds(f"/proc/{child.pid}/stat", self.tick) or 0.0
                main += _cpu_seconds(f"/proc/{child.pid}/task/{child.pid}/stat", self.tick) or 0.0
            now = time.monotonic()
            self.samples.append((now, total))
            self.main.append((now, main))
            self.machine.append((now, *_machine_jiffies()))

    def shares(self, progress: list[tuple[float, int]], seconds: float) -> tuple[float | None, float | None]:
        """Over the run that `progress` ended and that took `seconds`: the share of its wall time the main threads
        were on a CPU (per process, averaged), and the share of every core's time that was idle. None without
        samples."""
        if not progress or not seconds or len(self.machine) < 2:
            return None, None
        end = progress[-1][0]
        start = end - seconds
        (t0, main0), (t1, main1) = (_last_at(self.main, t) or self.main[0] for t in (start, end))
        (_, idle0, total0), (_, idle1, total1) = (_last_at(self.machine, t) or self.machine[0] for t in (start, end))
        busy = (main1 - main0) / (t1 - t0) / max(len(self.children), 1) if t1 > t0 else None
        idle = (idle1 - idle0) / (total1 - total0) if total1 > total0 else None
        return (None if busy is None else round(busy, 3)), (None if idle is None else round(idle, 3))

    def stop(self) -> None:
        self.done.set()
        self.join()

    def between(self, start: float, end: float) -> float:
        """CPU seconds spent between two monotonic times (the samples at or before each)."""
        def at(t: float) -> float:
            sample = _last_at(self.samples, t)
            return sample[1] if sample else 0.0
        return at(end) - at(start)

    def us_per_record(self, progress: list[tuple[float, int]], seconds: float, records: int) -> float | None:
        """CPU µs per record over the run that `progress` (the committed-offsets poller's samples) ended and
        that took `seconds`; None without samples."""
        if not progress or not records or not self.samples:
            return None
        end = progress[-1][0]
        return round(self.between(end - seconds, end) * 1e6 / records, 1)
