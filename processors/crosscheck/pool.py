"""The processes that cross-check partitions side by side. Partitions are independent (each its own ledger and
ledger time), so this process and `jobs - 1` others take them one at a time from a shared counter, in the
order given (the largest first), until none is left; each sends back what it made of its partitions. The
others are forked when this process runs a single thread, else spawned (docs/audit.md)."""

from __future__ import annotations

import os
from typing import Callable

from branch_settlement.processors.crosscheck.progress import Progress
from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.processors.replay.workers import gather_workers, send_outcome, start_workers, stop_workers
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas.codec import Codec, default_codec

# share(job, claim, progress, codec=None) -> {partition: outcome}: replays the partitions claim() gives
# (None when none is left), reporting events folded to progress(n). A module-level function, so that a
# spawned process can unpickle it.
Share = Callable[..., dict]


def process_count(jobs: int | None, partitions: list[int], codec: Codec, store_factory) -> int:
    """How many processes: `jobs` (default: one per core), at most one per partition; one when the codec or
    the stores are not the defaults the other processes would build."""
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:
            jobs = os.cpu_count() or 1
    if codec is not default_codec() or store_factory not in (None, MemoryStore):
        return 1  # the other processes build their own default codec and in-memory stores
    return max(1, min(jobs, len(partitions)))


def run_shares(share: Share, job, order: list[int], jobs: int, progress: Progress, codec: Codec) -> dict:
    """This process and `jobs - 1` fresh ones run `share` over the partitions of `order` until none is left;
    their outcomes merged, per partition. `progress` is shown the events folded by all of them."""
    if jobs == 1:
        taken = iter(order)
        return share(job, lambda: next(taken, None), progress, codec)
    ctx = _start_method()
    next_index = ctx.Value("i", 0)  # with its lock: the index in order of the next partition to take
    counter = ctx.Value("q", 0, lock=False)  # events folded by the other processes, for the progress bar
    workers = []
    try:
        start_workers(workers, ctx, _worker, [(share, job, order, next_index, counter)] * (jobs - 1))
        own_done = 0

        def own_progress(n: int) -> None:
            nonlocal own_done
            own_done += n
            progress.update(own_done + counter.value)

        results = share(job, claimer(order, next_index), own_progress, codec)
        gather_workers(workers, results, KafkaFailure)
        progress.update(own_done + counter.value)  # what the other processes folded after this one's last count
        return results
    finally:
        stop_workers(workers)


def _start_method():
    """fork when this process runs a single thread (nothing to import again, the codec already built), else
    spawn: a fork of a process holding librdkafka's (or any other) threads may inherit a lock held by one."""
    import multiprocessing

    try:
        single = len(os.listdir("/proc/self/task")) == 1
    except OSError:
        single = False
    return multiprocessing.get_context("fork" if single else "spawn")


def claimer(order: list[int], next_index) -> Callable[[], int | None]:
    """The next partition of `order` no process has taken yet, or None; `next_index` is shared by all."""
    def claim() -> int | None:
        with next_index.get_lock():
            i = next_index.value
            if i >= len(order):
                return None
            next_index.value = i + 1
        return order[i]
    return claim


def _worker(share: Share, job, order: list[int], next_index, counter, send) -> None:
    def progress(n: int) -> None:
        counter.value += n  # one writer per 1000 events each; a lost update only slows the bar

    send_outcome(send, lambda: share(job, claimer(order, next_index), progress))


__all__ = ["process_count", "run_shares", "claimer"]
