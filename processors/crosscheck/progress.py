"""The cross-check's progress: events re-folded out of the input's total, with rate and ETA, on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """A progress bar with rate and ETA on a terminal; a plain line every few seconds otherwise."""

    def __init__(self, total: int, stream=sys.stderr, every_s: float = 5.0) -> None:
        self.total, self.stream, self.every_s = max(total, 1), stream, every_s
        self.done = 0
        self.started = self.last = time.monotonic()
        self.tty = stream.isatty()

    def __call__(self, n: int) -> None:
        self.update(self.done + n)

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if not self.tty and now - self.last < self.every_s:
            return
        self.last = now
        rate = self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0
        if self.tty:
            filled = int(30 * min(self.done / self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {self.done:,}/{self.total:,} events "
                              f"{rate:,.0f}/s ETA {eta:,.0f} s ")
        else:
            self.stream.write(f"replayed {self.done:,}/{self.total:,} events, {rate:,.0f}/s, ETA {eta:,.0f} s\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")


__all__ = ["Progress"]
