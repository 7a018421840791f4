"""Debian packages the tests need (Chromium for the HTML report, Prometheus for the alert rules and the scrape),
installed with apt-get when missing, from the project's own files on a fresh machine. A test that needs one
fails, never skips, when it cannot be installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def run(cmd: list[str], timeout_s: int, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)


def debian_binary(binary: Path, package: str) -> Path:
    """`binary`, installing Debian's `package` with apt-get first when it is missing."""
    if binary.exists():
        return binary
    apt = shutil.which("apt-get")
    assert apt, f"{binary} is missing and there is no apt-get to install Debian's {package} package"
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    for cmd in (prefix + [apt, "update"], prefix + [apt, "install", "-y", "--no-install-recommends", package]):
        done = run(cmd, 1800)
        assert done.returncode == 0, (f"{binary} is missing and `{' '.join(cmd)}` failed with exit code "
                                      f"{done.returncode}:\n{done.stderr[-3000:]}")
    assert binary.exists(), f"apt-get installed {package} but {binary} does not exist"
    return binary
