"""End-to-end throughput of `settle run` (one or more processes in one group) and of the pass-through
ceiling, measured the same way: the backlog is written in a transaction held open while the consumers join,
released at once, and timed until the group has committed every input offset (progress.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.suite import passthrough
from bench.suite.backlog import HeldLoad, Record
from bench.suite.cpu import CpuSampler
from bench.suite.env import INPUT, Env, TopicSet
from bench.suite.procs import Procs, wait_assigned
from bench.suite.progress import CommittedPoller, Throughput
from branch_settlement.processors.crosscheck.readers import read_committed

RUN_TIMEOUT_S = 900.0


@dataclass
class Run:
    label: str
    throughput: Throughput
    inputs: dict[int, int]  # input records per partition
    peak_rss_mb: list[float]
    group: str
    state_dir: Path | None = None
    progress: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, offsets committed)
    checkpoints: list[dict] = field(default_factory=list)  # per process, from its log
    cpu_us_per_record: float | None = None  # every process of the run, release to last commit (cpu.py)
    main_thread_busy: float | None = None  # share of the run the processes' main threads were on a CPU (cpu.py)
    machine_idle: float | None = None  # share of every core's time idle during the run

    def as_dict(self) -> dict:
        return {**self.throughput.as_dict(), "cpu_us_per_record": self.cpu_us_per_record,
                "main_thread_busy": self.main_thread_busy, "machine_idle": self.machine_idle,
                "processes": len(self.peak_rss_mb), "peak_rss_mb": self.peak_rss_mb, "checkpoints": self.checkpoints}

    def progress_at(self, t: float) -> int:
        before = [n for ts, n in self.progress if ts <= t]
        return before[-1] if before else 0


def run_processors(env: Env, procs: Procs, topic_set: TopicSet, records: list[Record], processes: int,
                   work_dir: Path, label: str, keep_running: bool = False) -> tuple[Run, list]:
    """`processes` instances of `settle run` in one group on `topic_set`, through the backlog `records`.
    With `keep_running` the processes are returned still running (for a test that goes on with them)."""
    group = env.group(label)
    state_dir = work_dir / f"state-{label}"
    load = HeldLoad(env.client_config(), topic_set.name(INPUT), records, f"bench-{env.run_id}-load-{label}")
    children = [procs.processor(env.bootstrap_servers, topic_set.prefix, state_dir, group, f"{env.run_id}-{label}-{i}")
                for i in range(processes)]
    try:
        try:
            wait_assigned(children, topic_set.partitions)
        except BaseException:
            load.abort()
            raise
        poller = CommittedPoller(env.client_config(), group, topic_set.name(INPUT), load.per_partition)
        poller.start()
        sampler = CpuSampler(children)
        sampler.start()
        released = load.release()
        poller.wait(RUN_TIMEOUT_S, alive=lambda: [c.check_alive() for c in children])
        time.sleep(0.05)  # a CPU sample after the last commit seen
        sampler.stop()
    finally:
        if not keep_running:
            for child in children:
                procs.stop(child)
    rate = poller.throughput(released)
    busy, idle = sampler.shares(poller.samples, rate.seconds)
    run = Run(label, rate, load.per_partition, [c.peak_rss_mb for c in children], group, state_dir, poller.samples,
              [c.checkpoints() for c in children], sampler.us_per_record(poller.samples, rate.seconds, len(records)),
              main_thread_busy=busy, machine_idle=idle)
    return run, children


def load_and_wait(env: Env, topic_set: TopicSet, records: list[Record], label: str, group: str,
                  committed: dict[int, int], children: list) -> dict[int, int]:
    """Write `records` to the input of running processors and wait until `group` has committed them;
    `committed` is what it had committed before. Returns the new committed offsets per partition."""
    load = HeldLoad(env.client_config(), topic_set.name(INPUT), records, f"bench-{env.run_id}-load-{label}")
    targets = {p: committed.get(p, 0) + load.per_partition.get(p, 0) for p in range(topic_set.partitions)}
    poller = CommittedPoller(env.client_config(), group, topic_set.name(INPUT), targets)
    poller.start()
    load.release()
    poller.wait(RUN_TIMEOUT_S, alive=lambda: [c.check_alive() for c in children])
    return targets


def start_passthrough(env: Env, procs: Procs, plan_path: Path, target: TopicSet, label: str, echo: bool = False,
                      schedule: str = "end"):
    return procs.module("bench.suite.passthrough", [
        "--bootstrap-servers", env.bootstrap_servers, "--plan", str(plan_path), "--input", target.name(INPUT),
        "--output-prefix", target.prefix, "--group", env.group(label), "--schedule", schedule,
        "--transactional-id", f"bench-{env.run_id}-{label}", *(["--echo"] if echo else [])], label)


def run_ceiling(env: Env, procs: Procs, source: TopicSet, source_run: Run, target: TopicSet, plan_path: Path,
                label: str = "ceiling") -> tuple[Run, dict[str, int]]:
    """The pass-through on a copy of `source`'s input (same partitions, same bytes), producing the records
    the processor produced for `source_run`, checkpointing at the processor's default cadence. The plan
    stays at `plan_path` for the latency ceiling."""
    counts = passthrough.build_plan(env.client_config(), source, source_run.inputs, plan_path)
    copied = read_committed(env.client_config(), source.name(INPUT), range(source.partitions))
    records = [Record(p, key, value, None) for p, recs in sorted(copied.items()) for _, key, value in recs]
    load = HeldLoad(env.client_config(), target.name(INPUT), records, f"bench-{env.run_id}-load-{label}")
    child = start_passthrough(env, procs, plan_path, target, label)
    try:
        try:
            wait_assigned([child], target.partitions)
        except BaseException:
            load.abort()
            raise
        poller = CommittedPoller(env.client_config(), env.group(label), target.name(INPUT), load.per_partition)
        poller.start()
        sampler = CpuSampler([child])
        sampler.start()
        released = load.release()
        poller.wait(RUN_TIMEOUT_S, alive=child.check_alive)
        time.sleep(0.05)  # a CPU sample after the last commit seen
        sampler.stop()
    finally:
        procs.stop(child)
    rate = poller.throughput(released)
    busy, idle = sampler.shares(poller.samples, rate.seconds)
    return Run(label, rate, load.per_partition, [child.peak_rss_mb], env.group(label),
               checkpoints=[child.checkpoints()],
               cpu_us_per_record=sampler.us_per_record(poller.samples, rate.seconds, len(records)),
               main_thread_busy=busy, machine_idle=idle), counts
