"""bench/suite/cpu.py: the shares of a run's time that the processes' main threads were on a CPU and that the
machine's cores were idle, from the sampler's samples."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from bench.suite.cpu import CpuSampler

pytestmark = pytest.mark.unit


def test_shares_over_the_run_that_progress_ended() -> None:
    sampler = CpuSampler([SimpleNamespace(pid=1), SimpleNamespace(pid=2)])
    # 10 s of samples: the two main threads together 1.5 CPU seconds per second, the machine 40% idle after t=2
    for t in range(11):
        sampler.main.append((100.0 + t, 1.5 * t))
        sampler.machine.append((100.0 + t, 40 * t if t >= 2 else 0, 100 * t))
    busy, idle = sampler.shares([(104.0, 10), (110.0, 50)], seconds=6.0)  # the run: t = 4 .. 10
    assert busy == 0.75  # per process
    assert idle == 0.4
    assert sampler.shares([], 6.0) == (None, None)
    assert CpuSampler([]).shares([(1.0, 1)], 1.0) == (None, None)


def test_the_sampler_reads_this_process_and_the_machine() -> None:
    sampler = CpuSampler([SimpleNamespace(pid=os.getpid())])
    sampler.start()
    deadline = time.monotonic() + 10
    while len(sampler.machine) < 10 and time.monotonic() < deadline:  # 200 ms of samples at least
        sum(range(20_000))  # this (main) thread on a CPU meanwhile
        time.sleep(0)  # the sampler's thread needs the interpreter lock too
    sampler.stop()
    assert len(sampler.main) >= 10 and len(sampler.machine) >= 10
    assert sampler.main[-1][1] > sampler.main[0][1] > 0
    busy, idle = sampler.shares([(sampler.main[-1][0], 1)], sampler.main[-1][0] - sampler.main[0][0])
    assert busy is not None and busy > 0
    assert idle is not None and 0.0 <= idle <= 1.0
