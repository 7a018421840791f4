"""Processes the benchmark starts: `settle run` and the pass-through ceiling. Each is a child process with
its own log, a memory sampler (/proc/<pid>/status) and a clean stop (SIGTERM drains and commits; SIGKILL
only if it does not exit in time). `Procs` stops every process it started, whatever happens."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.suite.env import REPO
from branch_settlement.processors.kafka.config import ProcessorConfig

CHECKPOINT = re.compile(r"^\S+ (\d\d):(\d\d):(\d\d),(\d+) DEBUG .*checkpoint committed: (\d+) events, (\d+) records, "
                        r"([\d.]+) ms", re.M)
ASSIGNED = re.compile(r"assigned partitions \[([0-9, ]*)\]")
REVOKED = re.compile(r"revoked partitions")
STOP_TIMEOUT_S = 60.0
# The processor's ticks: from the system clock at the production default (the input carries none).
TICK_INTERVAL_MS = ProcessorConfig().tick_interval_ms
PROCESSOR_FLAGS = ("--tick-interval-ms", str(TICK_INTERVAL_MS), "--session-timeout-ms", "6000", "--log-level", "DEBUG")


def read_status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a live process, in kB; {} once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value = line.split(":", 1)
            found[name] = int(value.split()[0])
    return found


class MemorySampler(threading.Thread):
    """Samples VmRSS every `interval_s`; keeps the last VmHWM seen (the kernel's own peak) and the samples."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (monotonic time, VmRSS kB)
        self.hwm_kb = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            status = read_status_kb(self.pid)
            if not status:
                return
            self.samples.append((time.monotonic(), status.get("VmRSS", 0)))
            self.hwm_kb = max(self.hwm_kb, status.get("VmHWM", 0))
            self.done.wait(self.interval_s)


class Child:
    """One child process writing its output to a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})})
        self.memory = MemorySampler(self.proc.pid)
        self.memory.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(f"{' '.join(self.args[:5])} exited with {self.proc.returncode}:\n"
                               f"{self.output()[-3000:]}")

    def assignment(self) -> set[int] | None:
        """The partitions of the last assignment logged, or None if revoked since (or never assigned)."""
        current = None
        for line in self.output().splitlines():
            match = ASSIGNED.search(line)
            if match:
                current = {int(p) for p in match.group(1).replace(" ", "").split(",") if p}
            elif REVOKED.search(line):
                current = None
        return current

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (the processor drains and commits), then SIGKILL if it hangs. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.memory.done.set()
        self.memory.join(5)
        self._log.close()
        return self.proc.returncode

    def checkpoints(self, since: float = 0.0, until: float = 86_400.0) -> dict:
        """Checkpoint durations and spacing from the log (the processor's and the pass-through's DEBUG line),
        of the checkpoints logged between `since` and `until` (seconds since local midnight, clock_of_day)."""
        rows = []
        for h, m, s, ms, events, _records, duration in CHECKPOINT.findall(self.output()):
            at = int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000
            if since <= at <= until:
                rows.append((at, int(events), float(duration)))
        return checkpoint_summary(rows)

    @property
    def peak_rss_mb(self) -> float:
        return round(self.memory.hwm_kb / 1024, 1)


def checkpoint_summary(rows: list[tuple[float, int, float]]) -> dict:
    if len(rows) < 2:
        return {"checkpoints": len(rows)}
    durations = sorted(d for _, _, d in rows)
    gaps = sorted((b[0] - a[0]) * 1000 for a, b in zip(rows, rows[1:]))
    events = sorted(e for _, e, _ in rows)

    def pct(values, q):
        return round(values[min(len(values) - 1, int(len(values) * q))], 1)
    return {"checkpoints": len(rows), "commit_ms_p50": pct(durations, 0.5), "commit_ms_p99": pct(durations, 0.99),
            "commit_ms_max": durations[-1], "spacing_ms_p50": pct(gaps, 0.5), "spacing_ms_p99": pct(gaps, 0.99),
            "events_per_checkpoint_p50": pct(events, 0.5)}


def clock_of_day() -> float:
    """Seconds since local midnight, as the logs' timestamps count them."""
    now = time.localtime()
    return now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec + (time.time() % 1)


class Procs:
    """Every child process of the benchmark; `stop_all()` (also on exit) leaves none running."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def processor(self, bootstrap: str, topic_prefix: str, state_dir: Path, group: str, slot: str,
                  extra_args: tuple = (), env: dict | None = None) -> Child:
        """`settle run` with exactly-once defaults (commit_interval_ms 100, commit_events 2000), ticking from
        the system clock every TICK_INTERVAL_MS (ledger time, on ledger-ticks: the input carries no Ticks)."""
        args = [sys.executable, "-m", "branch_settlement.processors.cli.main", "run", "--bootstrap-servers", bootstrap,
                "--topic-prefix", topic_prefix, "--state-dir", str(state_dir), "--group-id", group,
                "--worker-slot", slot, *PROCESSOR_FLAGS, *extra_args]  # DEBUG: a line per checkpoint, its duration
        return self._start(args, f"processor-{group}-{slot}", env)

    def module(self, module: str, args: list[str], name: str) -> Child:
        return self._start([sys.executable, "-m", module, *args], name, None)

    def _start(self, args: list[str], name: str, env: dict | None) -> Child:
        child = Child(args, self.log_dir / f"{name}.log", env)
        self.children.append(child)
        return child

    def stop(self, child: Child) -> int:
        code = child.stop()
        if child in self.children:
            self.children.remove(child)
        return code

    def stop_all(self) -> None:
        for child in list(self.children):
            self.stop(child)


def wait_assigned(children: list[Child], partitions: int, timeout_s: float = 120.0, settle_s: float = 1.0) -> None:
    """Until the children's last logged assignments cover every partition once, and stay so `settle_s`."""
    deadline = time.monotonic() + timeout_s
    stable_since = None
    while time.monotonic() < deadline:
        for child in children:
            child.check_alive()
        owned = [child.assignment() for child in children]
        covered = all(o is not None for o in owned) and sorted(p for o in owned for p in o) == list(range(partitions))
        if covered:
            stable_since = stable_since or time.monotonic()
            if time.monotonic() - stable_since >= settle_s:
                return
        else:
            stable_since = None
        time.sleep(0.1)
    raise RuntimeError(f"partitions not assigned in {timeout_s} s: {[c.assignment() for c in children]}")
