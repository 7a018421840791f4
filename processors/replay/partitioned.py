"""Inputs of several partitions, kept apart: each partition has its own ledger and ledger time, so a
multi-partition replay folds each partition on its own, exactly as the processor does (an export file's
partitions, see export_format, side by side in worker processes)."""

from __future__ import annotations

import gc
from typing import Callable, Iterable, Iterator, TypeVar

from branch_settlement.processors.replay.export_format import export_input, export_partition_count, read_export_rows
from branch_settlement.processors.replay.replayer import Input, ReplayResult, _single_threaded, replay, replay_document
from branch_settlement.processors.replay.errors import ReplayError
from branch_settlement.processors.replay.workers import (_cores, gather_workers, send_outcome, start_workers,
                                                         stop_workers)
from branch_settlement.projections.store import MemoryStore, Store
from branch_settlement.schemas.codec import Codec

T = TypeVar("T")


def replay_partitions(inputs: dict[int, Iterable[Input]], codec: Codec, store_factory=MemoryStore,
                      progress=lambda events: None) -> dict[int, tuple[ReplayResult, Store]]:
    """Fold each partition's inputs into its own fresh store."""
    folded = {}
    for partition, items in sorted(inputs.items()):
        folded[partition] = replay(_counting(items, progress), store_factory(), codec=codec, partition=partition)
    return folded


def _counting(items: Iterable[Input], progress) -> Iterator[Input]:
    for n, item in enumerate(items, start=1):
        yield item
        if n % 1000 == 0:
            progress(1000)


def merged_document(folded: dict[int, tuple[ReplayResult, Store]], codec: Codec) -> dict:
    """One SPEC §12 document for several partitions: ledgers merged (a parent lives in one partition),
    outputs in (partition, offset) order."""
    return merge_documents({p: partition_document(p, result, store, codec) for p, (result, store) in folded.items()})


def partition_document(partition: int, result: ReplayResult, store: Store, codec: Codec) -> dict:
    """One partition's part of `merged_document`."""
    part = replay_document(result, store, codec)
    part["dead_letters"] = [{"partition": partition, "offset": letter["offset"], "reason": letter["reason"]}
                            for letter in result.dead_letters]
    return part


def merge_documents(parts: dict[int, dict]) -> dict:
    doc = {"parents": {}, "children": {}, "results": [], "releases": [], "dead_letters": []}
    for _, part in sorted(parts.items()):
        doc["parents"].update(part["parents"])
        doc["children"].update(part["children"])
        doc["results"].extend(part["results"])
        doc["releases"].extend(part["releases"])
        doc["dead_letters"].extend(part["dead_letters"])
    doc["parents"] = dict(sorted(doc["parents"].items()))
    doc["children"] = dict(sorted(doc["children"].items()))
    return doc


def replay_export(path, codec: Codec, render: Callable[[int, ReplayResult, Store], T],
                  jobs: int | None = None, progress: Callable[[int], None] | None = None) -> dict[int, T]:
    """Fold each partition of an export file into a fresh in-memory store and `render` it (what is kept of
    a partition: a document, a text). The partitions are independent, so when this process runs a single
    thread, `jobs - 1` forked processes (default: one per core in all) take partitions too, the largest
    first, and send back what `render` made of them; the file is read once, here. `progress(n)`: told of
    the records folded by every process, by thousands (from this process only)."""
    rows = read_export_rows(path)
    count = export_partition_count(path)
    order = sorted(rows, key=lambda p: (-len(rows[p]), p))
    report = [progress or (lambda n: None)]  # in a forked process: a shared counter instead

    def one(p: int) -> T:
        items = (export_input(row, codec) for row in rows[p])
        result, store = replay(_counting(items, lambda n: report[0](n)), MemoryStore(), codec=codec,
                               partition=p, partitions=count)
        return render(p, result, store)

    jobs = min(len(order), jobs or _cores())
    if jobs <= 1 or not _single_threaded():
        return {p: one(p) for p in sorted(order)}
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    next_index = ctx.Value("i", 0)
    folded = ctx.Value("q", 0, lock=False)  # records folded by the forked processes
    seen = [0]  # of the forked processes' records, told to progress so far

    def in_worker(n: int) -> None:
        folded.value += n  # one writer per 1000 records each; a lost update only slows the progress

    def in_this_process(n: int) -> None:
        theirs = folded.value
        if progress is not None:
            progress(n + theirs - seen[0])
        seen[0] = theirs

    def claim() -> int | None:
        with next_index.get_lock():
            i = next_index.value
            next_index.value = i + 1
        return order[i] if i < len(order) else None

    def in_worker_take_all() -> dict[int, T]:
        report[0] = in_worker
        return take_all()

    def take_all() -> dict[int, T]:
        done = {}
        while (p := claim()) is not None:
            done[p] = one(p)
        return done

    workers = []
    try:
        gc.freeze()  # the forked processes' collector leaves the rows alone: their pages stay shared
        try:
            start_workers(workers, ctx, lambda send: send_outcome(send, in_worker_take_all), [()] * (jobs - 1))
        finally:
            gc.unfreeze()
        report[0] = in_this_process
        done = take_all()
        gather_workers(workers, done, ReplayError)
        return dict(sorted(done.items()))
    finally:
        stop_workers(workers)
