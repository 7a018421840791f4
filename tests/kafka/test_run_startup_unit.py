"""`settle run` honours SIGTERM and SIGINT during its start-up: its drain handler is installed before the
preflight, a signal there ends the preflight's wait for the brokers at once, and the processor exits 0
without starting (nothing folded, nothing to commit). No broker is needed: nothing answers on port 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def handles(pid: int, signum: int) -> bool:
    """Whether the process has a handler for the signal (Linux: SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_preflight_stops_at_once_and_cleanly(tmp_path: Path, signum: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "branch_settlement.processors.cli.main", "run", "--bootstrap-servers",
         "127.0.0.1:1", "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        # SIGTERM's handler, installed with SIGINT's by the drain (Python's own SIGINT handler is there from
        # the interpreter's start, before settle's modules are even imported)
        while not handles(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.02)
        time.sleep(0.5)  # well inside the preflight's wait for metadata (15 s)
        sent = time.monotonic()
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=10)
        stopped_after = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, output
    assert f"stopped before starting: {signal.Signals(signum).name} received during start-up" in output, output
    assert stopped_after < 10, stopped_after  # long before the preflight's deadline
    assert "no metadata" not in output and "processor running" not in output, output
    assert not (tmp_path / "state").exists()
