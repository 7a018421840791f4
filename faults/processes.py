"""`settle run` as a separate process (so it can be killed, stopped, paused and resumed), and what its log
says about transactions, fences and crashes. The processors run at DEBUG so every committed checkpoint is
logged ("checkpoint committed"); a non-committed checkpoint logs one of ABORT_MARKERS. They tick from the
system clock, as in production, every TICK_INTERVAL_MS: ledger time moves a few times a second, so the
workload's shortened leases (faults/adversity.py) expire within the scenario, and an idle processor still
commits a checkpoint (its ticks) twice a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from faults.kafka_io import REPO

COMMITTED_MARKER = "checkpoint committed"
ABORT_MARKERS = ("checkpoint aborted", "commit_transaction failed and was aborted", "recreating the producer",
                 "reloading every partition from the committed offsets")
FENCE_MARKERS = ("fenced",)
TICK_INTERVAL_MS = 500


@dataclass(frozen=True)
class LogStats:
    committed: int
    aborted: int
    fencing_errors: int
    crash_points: int
    critical: int

    def __add__(self, other: "LogStats") -> "LogStats":
        return LogStats(*(a + b for a, b in zip(self.__dict__.values(), other.__dict__.values())))


def log_stats(text: str) -> LogStats:
    lines = text.splitlines()
    return LogStats(
        committed=sum(COMMITTED_MARKER in line for line in lines),
        aborted=sum(any(m in line for m in ABORT_MARKERS) for line in lines),
        fencing_errors=sum("WARNING" in line and "fenced" in line or "ERROR" in line and "fenced" in line
                           for line in lines),
        crash_points=sum("crash point" in line and "reached" in line for line in lines),
        critical=sum(" CRITICAL " in line for line in lines),
    )


class ProcessorProcess:
    def __init__(self, bootstrap: str, prefix: str, state_dir: Path, log_path: Path, *, slot: str, group: str,
                 env: dict | None = None, args: tuple = (), session_timeout_ms: int = 6000) -> None:
        self.log_path = log_path
        self.slot = slot
        self._offset = log_path.stat().st_size if log_path.exists() else 0
        command = [sys.executable, "-m", "branch_settlement.processors.cli.main", "run", "--bootstrap-servers", bootstrap,
                   "--topic-prefix", prefix, "--state-dir", str(state_dir), "--group-id", group,
                   "--worker-slot", slot, "--tick-interval-ms", str(TICK_INTERVAL_MS),
                   "--session-timeout-ms", str(session_timeout_ms), "--commit-interval-ms", "100",
                   "--log-level", "DEBUG", *args]
        self._log = open(log_path, "ab")
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=REPO)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.proc.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def stop(self, timeout_s: float = 120) -> int:
        """SIGTERM (after SIGCONT, in case it is stopped); SIGKILL if it does not drain in time."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(30)
        self._log.close()
        return code

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self._log.close()
        return code

    def output(self) -> str:
        """This process's part of the log file (several processes may have appended to it in turn)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._offset)
            return f.read().decode(errors="replace")

    def state(self) -> str:
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"
