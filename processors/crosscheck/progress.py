"""Progress of the long commands (produce, export, replay, audit --topic), on stderr and never on stdout: a
tqdm bar on a terminal; elsewhere (logs, pipes, CI) at most a plain line every few seconds; nothing at all
with --no-progress. The bar is tqdm's (https://tqdm.github.io), not a hand-written one."""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

# tqdm's monitor thread would make this process multi-threaded, and the replays fork worker processes only
# from a single-threaded one (processors/crosscheck/pool.py, processors/replay/sharded.py).
tqdm.monitor_interval = 0

AUTO, BAR, OFF = "auto", "bar", "off"
MODES = (AUTO, BAR, OFF)


class Progress:
    """`done` of `total` (None: not known) `unit`, shown as `mode` says: BAR a tqdm bar; AUTO a bar when
    `stream` is a terminal, else a plain line every `every_s` seconds; OFF nothing. Call it with a count to
    add, or `update` with the count done; `finish` (or leaving its `with` block) ends it."""

    def __init__(self, total: int | None, stream=None, every_s: float = 5.0, unit: str = "events",
                 verb: str = "replayed", mode: str = AUTO) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(MODES)}")
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.every_s, self.unit, self.verb = total, every_s, unit, verb
        self.done = 0
        self.started = self.last = time.monotonic()
        self.tty = _isatty(self.stream)
        self.bar = None
        self.plain = mode == AUTO and not self.tty
        if mode == BAR or (mode == AUTO and self.tty):
            sized = _columns(self.stream) > 0  # a terminal that tells its width (a bare pty tells 0)
            self.bar = tqdm(total=total, file=self.stream, unit=f" {unit}", desc=verb, dynamic_ncols=sized,
                            ncols=None if sized else 80, nrows=None if sized else 24, unit_scale=False,
                            mininterval=0.2, leave=True)

    def __call__(self, n: int) -> None:
        self.update(self.done + n)

    def update(self, done: int) -> None:
        self.done = done
        if self.bar is not None:
            if done > self.bar.n:
                self.bar.update(done - self.bar.n)
            return
        if not self.plain or (self.total is not None and done >= self.total):
            return  # a plain line says how far a run is, not that it is done: the command says that
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9)
        if self.total is None:
            line = f"{self.verb} {done:,} {self.unit}, {rate:,.0f}/s"
        else:
            eta = max(self.total - done, 0) / rate if rate else 0
            line = f"{self.verb} {done:,}/{self.total:,} {self.unit}, {rate:,.0f}/s, ETA {eta:,.0f} s"
        self.stream.write(line + "\n")
        self.stream.flush()

    def write(self, line: str) -> None:
        """A line of the command's own on the progress's stream (stderr), above the bar when there is one."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def complete(self) -> None:
        """All of the total is done (what was counted in rounded steps)."""
        if self.total is not None:
            self.update(self.total)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *_exc) -> None:
        self.finish()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def count_lines(path: str) -> int:
    """The lines of a file (the last one without its line break included), for a JSON Lines file's total."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


__all__ = ["Progress", "AUTO", "BAR", "OFF", "MODES", "count_lines"]
