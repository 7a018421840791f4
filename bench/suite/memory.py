"""Peak RSS of `settle run` with a large ledger, and whether it grows with the ledger.

1. fill: one processor folds `children` ChildReserved events (parents of 64), VmRSS sampled as the ledger
   grows (children committed -> MB), then folds a realistic batch on top;
2. reopen: a new processor on the same projections (the ledger already large) folds another realistic batch;
3. restore: the projections deleted, a new processor rebuilds them from the changelog, then folds a third.
Each phase's peak is the kernel's VmHWM of that process (/proc/<pid>/status)."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.suite import throughput
from bench.suite.backlog import FILL_CHILDREN_PER_PARENT, Record, encode_workload, ledger_fill_events
from bench.suite.env import Env, TopicSet
from bench.suite.procs import Procs, wait_assigned
from bench.suite.progress import rate_between

RSS_CURVE_POINTS = 12
RESTORE_TIMEOUT_S = 1800.0
FILL_EVENTS_PER_S_AT_LEAST = 500  # the fill's time limit (a hang guard): at least len(fill) / 500 s (2.8 h for 5M children)


class FillRecords:
    """The ledger fill (backlog.ledger_fill) as input records encoded while they are produced: 5M children
    held as a list would cost the driver ~2.5 GB."""

    def __init__(self, children: int, partitions: int) -> None:
        self.parents = (children + FILL_CHILDREN_PER_PARENT - 1) // FILL_CHILDREN_PER_PARENT
        self.partitions = partitions

    def __len__(self) -> int:
        return self.parents * (1 + FILL_CHILDREN_PER_PARENT)

    def __iter__(self):
        from branch_settlement.schemas.codec import default_codec
        codec = default_codec()
        chunk = []
        for event in ledger_fill_events(self.parents * FILL_CHILDREN_PER_PARENT):
            chunk.append(event)
            if len(chunk) == 1 + FILL_CHILDREN_PER_PARENT:
                yield from encode_workload(chunk, self.partitions, codec)
                chunk.clear()
        yield from encode_workload(chunk, self.partitions, codec)


@dataclass
class MemoryResult:
    children: int
    fill: dict
    phases: dict[str, float] = field(default_factory=dict)  # phase -> peak RSS MB
    curve: list[dict] = field(default_factory=list)
    restore_s: float | None = None  # the restarting processor: from start to its partitions assigned

    def as_dict(self) -> dict:
        return {"children_in_ledger": self.children, "peak_rss_mb": max(self.phases.values()),
                "peak_rss_mb_by_phase": self.phases, "fill": self.fill, "rss_vs_ledger": self.curve,
                "processor_restart_with_restore_s": self.restore_s}


def measure(env: Env, procs: Procs, topic_set: TopicSet, children: int, on_top: list[list[Record]],
            work_dir: Path) -> MemoryResult:
    fill = FillRecords(children, topic_set.partitions)
    run_timeout_s = throughput.RUN_TIMEOUT_S
    throughput.RUN_TIMEOUT_S = max(run_timeout_s, len(fill) / FILL_EVENTS_PER_S_AT_LEAST)
    try:
        run, running = throughput.run_processors(env, procs, topic_set, fill, 1, work_dir, "memory",
                                                 keep_running=True)
    finally:
        throughput.RUN_TIMEOUT_S = run_timeout_s
    child = running[0]
    group, slot = run.group, f"{env.run_id}-memory-0"
    try:
        committed = throughput.load_and_wait(env, topic_set, on_top[0], "memory-top-1", group, run.inputs, [child])
    finally:
        procs.stop(child)
    total = run.throughput.records
    result = MemoryResult(children, {**run.throughput.as_dict(), "children_per_parent": FILL_CHILDREN_PER_PARENT,
                                     # does folding slow down as the ledger grows?
                                     "events_per_s_10_to_50": round(rate_between(run.progress, total, 0.1, 0.5)),
                                     "events_per_s_50_to_90": round(rate_between(run.progress, total, 0.5, 0.9))})
    result.phases["fill"] = child.peak_rss_mb
    per_record = children / max(run.throughput.records, 1)
    fill_window = (run.progress[0][0], run.progress[-1][0]) if run.progress else (0, 0)
    samples = [(t, kb) for t, kb in child.memory.samples if fill_window[0] <= t <= fill_window[1]]
    # Where the fill phase's peak is: while the ledger grows, or in the realistic batch and the drain after it.
    after = [kb for t, kb in child.memory.samples if t > fill_window[1]]
    result.fill["peak_rss_mb_while_filling"] = round(max((kb for _, kb in samples), default=0) / 1024, 1)
    result.fill["peak_rss_mb_after_the_fill"] = round(max(after, default=0) / 1024, 1)
    for t, kb in samples[:: max(1, len(samples) // RSS_CURVE_POINTS)]:
        result.curve.append({"children": int(run.progress_at(t) * per_record), "rss_mb": round(kb / 1024, 1)})

    def again(phase: str, records: list[Record], committed: dict[int, int]) -> dict[int, int]:
        restarted = procs.processor(env.bootstrap_servers, topic_set.prefix, run.state_dir, group, slot)
        try:
            wait_assigned([restarted], topic_set.partitions, timeout_s=RESTORE_TIMEOUT_S, settle_s=0)
            if phase == "restore":
                result.restore_s = round(time.monotonic() - restarted.started_at, 1)
            committed = throughput.load_and_wait(env, topic_set, records, f"memory-{phase}", group, committed,
                                                 [restarted])
        finally:
            procs.stop(restarted)
        result.phases[phase] = restarted.peak_rss_mb
        return committed

    committed = again("reopen", on_top[1], committed)
    shutil.rmtree(run.state_dir / group)
    again("restore", on_top[2], committed)
    return result
