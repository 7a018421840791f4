"""`python -m faults.reaper PID RUN_DIR`: kills the Kafka nodes under RUN_DIR once process PID is gone.

The replicated cluster's nodes run in sessions of their own (deploy/kafka.sh starts each with setsid, so a
Ctrl-C meant for the suite does not reach them), and a suite that is itself killed (SIGKILL, a CI timeout)
runs no `finally`. The cluster starts this reaper beside it, in a session of its own too: every second it
checks whether the process that started the cluster is still alive; once it is not, it kills (SIGKILL) each
node whose pid file is under RUN_DIR and whose command line names that run directory, and exits. It also
exits when RUN_DIR is gone. It never touches any other process."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of a dead parent is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def node_pids(run_dir: Path) -> list[int]:
    pids = []
    for pid_file in run_dir.glob("*/pid"):
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):
            continue
        if b"kafka.Kafka" in cmdline and str(pid_file.parent).encode() in cmdline:
            pids.append(pid)
    return pids


def main(argv: list[str]) -> int:
    parent, run_dir = int(argv[0]), Path(argv[1])
    while alive(parent):
        if not run_dir.exists():
            return 0
        time.sleep(1.0)
    for pid in node_pids(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
