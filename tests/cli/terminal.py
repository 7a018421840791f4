"""Run a command with its stderr on a pseudo-terminal (pty), as a user at a terminal does, its stdout to a
file (machine output, unchanged): what each side got."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import tempfile
import termios
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def settle_on_terminal(*args: str, stdin: bytes | None = None, columns: int = 120) -> tuple[int, bytes, bytes]:
    """(exit code, stdout, what the terminal showed) of `settle ARGS` with stderr on a pty `columns` wide (0:
    a bare pty that tells no size, as some CI runners and `script` give)."""
    master, slave = pty.openpty()
    if columns:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], cwd=REPO,
                                stdout=out, stderr=slave, stdin=subprocess.PIPE if stdin is not None else None)
        os.close(slave)
        if stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.close()
        shown = b""
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # the last writer closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        code = proc.wait(600)
        os.close(master)
        out.seek(0)
        return code, out.read(), shown


PLAIN_PROGRESS = re.compile(rb"(replayed|read|written|sent) [\d,]+(/[\d,]+)? \w+, [\d,]+/s(, ETA [\d,]+ s)?")


def only_progress(stderr: bytes) -> bool:
    """Whether stderr holds nothing but the plain progress lines of a run not on a terminal (one every few
    seconds at most: a slow machine may print some)."""
    return all(PLAIN_PROGRESS.fullmatch(line) for line in stderr.splitlines())


def settle(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], input=stdin,
                          capture_output=True, cwd=REPO, timeout=600)
